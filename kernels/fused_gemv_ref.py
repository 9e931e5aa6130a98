"""kernels/fused_gemv.py's computation in torch, as the transformers modules it replaces compute
it: the reference its tests hold the kernel to, and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8_gemv import dequantize_weight
from .lora_epilogue import LoraEpilogue, lora_epilogue_ref


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False
) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm, or with plus_one Gemma2RMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}


def fused_gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    up_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    up_scale: torch.Tensor | None = None,
    norm_plus_one: bool = False,
    activation: str = "silu",
    lora: LoraEpilogue | None = None,
) -> torch.Tensor:
    """What the kernel computes, as the transformers modules it replaces compute it (FP8
    weights with their block scales: as Fp8Linear's weight-only product; LoRA deltas as peft
    adds them to the base product)."""
    if weight_scale is not None:
        weight = dequantize_weight(weight, weight_scale).to(x.dtype)
    if up_scale is not None:
        up_weight = dequantize_weight(up_weight, up_scale).to(x.dtype)
    if rows is not None:
        x = x[rows]
    inv_rms = None
    if norm_weight is not None:
        inv_rms = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
        x = rms_norm_ref(x, norm_weight, eps, norm_plus_one)
    y = F.linear(x, weight, bias)
    n = y.shape[-1]
    if lora is not None:
        y = lora_epilogue_ref(lora, y, slice(0, n), inv_rms)
    if up_weight is not None:
        up = F.linear(x, up_weight)
        if lora is not None:
            up = lora_epilogue_ref(lora, up, slice(n, 2 * n), inv_rms)
        y = ACTIVATIONS[activation](y) * up
    if residual is not None:
        y = residual + y
    return y
