"""residual + RMSNorm(x) for a handful of rows in one launch: Gemma 2's sandwich norms.

Gemma 2 normalises the attention output and the MLP output before each residual add
(post_attention_layernorm, post_feedforward_layernorm). The norm spans the whole hidden row,
which the GEMV before it splits over many programs, so it cannot sit in that GEMV's epilogue;
in torch it is ~8 elementwise launches (fp32 cast, square, mean, rsqrt, two products, the cast
back, the add) per norm, 2 a layer. This kernel is one: a program a row, the row in registers.

Rounding as Gemma2RMSNorm and the add compute it: x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32,
rounded once to the model dtype, then residual + that, rounded again (PLUS_ONE; without it,
LlamaRMSNorm's rounding: normalised x to the model dtype, times w in the model dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_gemv import gdc_launch_dependents, gdc_wait, rms_norm_ref
from .gemv_math import rms_scale
from .host_math import next_power_of_2
from .kv_write import check_launchable


def residual_rms_norm_ref(
    x: torch.Tensor,  # [R, N]
    residual: torch.Tensor,  # [R, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    plus_one: bool = False,
) -> torch.Tensor:
    return residual + rms_norm_ref(x, weight, eps, plus_one)


@triton.jit
def _residual_rms_norm_kernel(
    x_ptr,  # [R, N]
    r_ptr,  # [R, N]
    w_ptr,  # [N]
    y_ptr,  # [R, N] out
    eps,
    stride_x,
    stride_r,
    stride_y,
    N: tl.constexpr,
    N_PAD: tl.constexpr,  # next power of 2
    PLUS_ONE: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, N_PAD)
    mask = offs < N
    g = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # weights: before the wait
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    h = rms_scale(x * inv_rms, g, dt, PLUS_ONE).to(tl.float32)
    res = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (res + h).to(dt), mask=mask)


def residual_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    plus_one: bool = False,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """residual_rms_norm_ref by one Triton launch (rows contiguous in their last dimension)."""
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(
            f"x and residual must be one [R, N] shape and weight [N], got {list(x.shape)}, "
            f"{list(residual.shape)}, {list(weight.shape)}"
        )
    if residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"x, residual and weight must be one dtype, got {x.dtype}")
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    check_launchable(x, "x")
    y = torch.empty_like(x)
    r, n = x.shape
    if r == 0:
        return y
    n_pad = next_power_of_2(n)
    _residual_rms_norm_kernel[(r,)](
        x,
        residual,
        weight,
        y,
        float(eps),
        x.stride(0),
        residual.stride(0),
        y.stride(0),
        N=n,
        N_PAD=n_pad,
        PLUS_ONE=plus_one,
        PDL=pdl,
        num_warps=min(16, max(4, n_pad // 512)),
        **({"launch_pdl": True} if pdl else {}),
    )
    return y
