"""FP8 KV cache: the cache dtype an option names, and each layer's K and V scales.

The cache stores K / k_scale and V / v_scale as float8 (saturated to the format's largest
finite value); the attention kernels read scale * stored (kernels/kv_write.py,
kernels/paged_attention.py). Scales are per tensor, one for K and one for V in each layer:
  - given (`kv_cache_scale=s`): s for every layer's K and V;
  - else calibrated at start-up: one forward of CALIBRATION_TOKENS fixed pseudo-random tokens
    through the model's eager attention records each layer's largest |K| and |V|, and the
    scale maps HEADROOM times that onto the format's largest value, so activations up to
    HEADROOM times the calibration's are stored unclipped (larger ones saturate).
Per-tensor scales keep the kernels' dequantisation to one multiply folded into the softmax
scale (K) and the output normalisation (V); FP8 keeps its relative precision (3 mantissa bits
for e4m3, 2 for e5m2) anywhere in its range, so a per-head scale would only matter for heads
whose values sit far below the others', near the subnormals.
"""

from __future__ import annotations

import math
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


def kv_cache_scales(
    model: torch.nn.Module, num_layers: int, dtype: torch.dtype, given: float | None
) -> list[tuple[float, float]] | None:
    """(k_scale, v_scale) per layer for an FP8 cache; None for a float cache."""
    if not is_fp8(dtype):
        return None
    if given is not None:
        return [(float(given), float(given))] * num_layers
    from hf_paged.kernels.kv_write import FP8_MAX

    amax = _calibrate(model)
    fmax = FP8_MAX[dtype]
    scales = []
    for layer in range(num_layers):
        k_max, v_max = amax.get(layer, (0.0, 0.0))
        if not (math.isfinite(k_max) and math.isfinite(v_max)):
            raise ValueError(
                f"kv_cache_dtype: layer {layer}'s keys or values are not finite in the "
                "calibration forward; pass kv_cache_scale to set the scale"
            )
        # a layer the forward did not reach (or all zeros): scale 1, values stored as they are
        scales.append(
            tuple(HEADROOM * m / fmax if m > 0 else 1.0 for m in (k_max, v_max))  # type: ignore[misc]
        )
    return scales


@torch.inference_mode()
def _calibrate(model: torch.nn.Module) -> dict[int, list[float]]:
    """layer_idx -> [max |K|, max |V|] over one forward under the modelling file's eager
    attention (it applies every argument a model passes: softcaps, sinks, windows)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    cfg = model.config.get_text_config()
    vocab = getattr(cfg, "vocab_size", None) or 4
    length = min(CALIBRATION_TOKENS, getattr(cfg, "max_position_embeddings", None) or 64)
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(min(3, vocab - 1), vocab, (1, length), generator=gen).to(device)
    amax: dict[int, list[float]] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int):
            seen = amax.setdefault(layer, [0.0, 0.0])
            seen[0] = max(seen[0], float(key.abs().amax()))
            seen[1] = max(seen[1], float(value.abs().amax()))
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
