"""transformers' own forward as it would run over an FP8 KV cache: the reference the start-up
check (hf_paged/engine/verify.py) and the tests compare the engine's FP8-cache logits with.

Inside `fake_quantized_kv(model, dtype, scales)` each attention call of the model's own
implementation (sdpa, eager, ...) sees its keys and values rounded as the paged cache stores
them (x / scale in the FP8 format, saturated, times scale), every other op unchanged: the paged
forward must then agree to float rounding, as it does without FP8.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

FAKE_QUANT_IMPL = "hf_paged_fp8_kv_reference"

# (the wrapped attention implementation's name, cache dtype, (k_scale, v_scale) per layer)
_active: tuple[str, torch.dtype, list[tuple]] | None = None


def round_like_cache(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """x [batch, kv heads, tokens, head_dim] as an FP8 cache of that dtype and scale (a float,
    or one per KV head) returns it to the attention."""
    from hf_paged.kernels.kv_write import quantize_ref

    if isinstance(scale, torch.Tensor):
        scale = scale.to(x.device)[:, None, None]
    return (quantize_ref(x, dtype, scale).float() * scale).to(x.dtype)


@contextlib.contextmanager
def fake_quantized_kv(model: torch.nn.Module, dtype: torch.dtype, scales):
    """Run the model's current attention implementation over FP8-rounded K/V (a no-op when
    scales is None: a float cache)."""
    global _active
    if scales is None:
        yield
        return
    inner = model.config._attn_implementation
    AttentionInterface.register(FAKE_QUANT_IMPL, _attention)
    AttentionMaskInterface.register(FAKE_QUANT_IMPL, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    previous, _active = _active, (inner, dtype, scales)
    model.set_attn_implementation(FAKE_QUANT_IMPL)
    try:
        yield
    finally:
        model.set_attn_implementation(inner)
        _active = previous


def _attention(module, query, key, value, attention_mask, **kwargs):
    inner, dtype, scales = _active
    k_scale, v_scale = scales[module.layer_idx]
    key = round_like_cache(key, dtype, k_scale)
    value = round_like_cache(value, dtype, v_scale)
    if inner in ALL_ATTENTION_FUNCTIONS:
        fn = ALL_ATTENTION_FUNCTIONS[inner]
    else:  # "eager": the module's own modelling file defines it
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return fn(module, query, key, value, attention_mask, **kwargs)
