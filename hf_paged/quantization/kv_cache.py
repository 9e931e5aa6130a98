"""FP8 KV cache: the cache dtype an option names, and each layer's K and V scales.

The cache stores K / k_scale and V / v_scale as float8 (saturated to the format's largest
finite value); the attention kernels read scale * stored (kernels/kv_write.py,
kernels/paged_attention.py). Scales are either
  - given (`kv_cache_scale=s`): s for every layer's K and V, a float the kernels fold in (into
    the softmax scale for K, the output normalisation for V);
  - or calibrated at start-up, one per KV head: one forward of CALIBRATION_TOKENS fixed
    pseudo-random tokens through the model's eager attention records each head's largest |K|
    and |V|, and the scale maps HEADROOM times that onto the format's largest value, so
    activations up to HEADROOM times the calibration's are stored unclipped (larger ones
    saturate). Per head rather than per layer: on SmolLM2-135M the perplexity cost of an e4m3
    cache fell from +1.36% (per layer) to +0.86% (docs/quantization.md). The kernels take one
    scale per layer, so `fold_head_scales` applies per-head scales around them: K and V divided
    by their heads' scales before the write (kernel scale 1), each query head times its KV
    head's k_scale (q.(s k) = (s q).k) and each output head times its KV head's v_scale
    (sum_j p_j s v_j = s sum_j p_j v_j).
"""

from __future__ import annotations

import sys

import torch

FP8_KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CALIBRATION_TOKENS = 256
HEADROOM = 4.0

_CALIBRATION_IMPL = "hf_paged_kv_calibration"


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the kv_cache_dtype option ("auto": the model's)."""
    if name == "auto":
        return model_dtype
    if name in FP8_KV_CACHE_DTYPES:
        return FP8_KV_CACHE_DTYPES[name]
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"kv_cache_dtype {name!r} is not a float dtype")
    return dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_CACHE_DTYPES.values()


Scale = float | torch.Tensor  # per layer, or float32 [num_kv_heads] per KV head


def kv_cache_scales(
    model: torch.nn.Module,
    kv_heads: list[int],
    dtype: torch.dtype,
    given: float | None,
) -> list[tuple[Scale, Scale]] | None:
    """(k_scale, v_scale) per layer (kv_heads: each layer's KV heads in the cache) for an FP8
    cache; None for a float cache."""
    if not is_fp8(dtype):
        return None
    if given is not None:
        return [(float(given), float(given))] * len(kv_heads)
    from hf_paged.kernels.kv_write import FP8_MAX

    amax = _calibrate(model)
    fmax = FP8_MAX[dtype]
    device = next(model.parameters()).device
    scales = []
    for layer, heads in enumerate(kv_heads):
        pair = []
        for m in amax.get(layer, (torch.zeros(heads), torch.zeros(heads))):
            if not bool(m.isfinite().all()):
                raise ValueError(
                    f"kv_cache_dtype: layer {layer}'s keys or values are not finite in the "
                    "calibration forward; pass kv_cache_scale to set the scale"
                )
            if m.numel() != heads:  # the attention saw other heads than the cache holds
                m = m.amax().expand(heads)
            # a head the forward left all zeros (or a layer it did not reach): scale 1
            pair.append(torch.where(m > 0, HEADROOM * m / fmax, 1.0).float().to(device))
        scales.append(tuple(pair))
    return scales


def fold_head_scales(q, k, v, k_scale: torch.Tensor, v_scale: torch.Tensor):
    """Per-KV-head scales applied outside the kernels (q [T, Hq, D], k/v [T, Hkv, D]):
    (q times k_scale per query head, k / k_scale, v / v_scale in float32 for the cache write,
    the [Hq, 1] factor of the attention output); the kernels then run with scales 1."""
    group = q.shape[1] // k.shape[1]
    k = k.float() * (1.0 / k_scale)[:, None]
    v = v.float() * (1.0 / v_scale)[:, None]
    # in float32: a bf16 copy of the scale would scale every logit of the head by its rounding
    q = (q.float() * k_scale.repeat_interleave(group)[:, None]).to(q.dtype)
    return q, k, v, v_scale.repeat_interleave(group)[:, None]


@torch.inference_mode()
def _calibrate(model: torch.nn.Module) -> dict[int, list[torch.Tensor]]:
    """layer_idx -> [max |K|, max |V|] per KV head (float32 [Hkv], on the CPU) over one forward
    under the modelling file's eager attention (it applies every argument a model passes:
    softcaps, sinks, windows)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    cfg = model.config.get_text_config()
    vocab = getattr(cfg, "vocab_size", None) or 4
    length = min(CALIBRATION_TOKENS, getattr(cfg, "max_position_embeddings", None) or 64)
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=gen).to(device)
    amax: dict[int, list[torch.Tensor]] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int):  # key, value: [batch, kv heads, tokens, head_dim]
            k, v = (t.abs().float().amax(dim=(0, 2, 3)).cpu() for t in (key, value))
            seen = amax.get(layer)
            amax[layer] = [k, v] if seen is None else [seen[0].maximum(k), seen[1].maximum(v)]
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CALIBRATION_IMPL, record)
    AttentionMaskInterface.register(_CALIBRATION_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    current = model.config._attn_implementation
    model.set_attn_implementation(_CALIBRATION_IMPL)
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(current)
    return amax
