"""Activations to FP8 for the blockwise FP8 GEMM, one launch.

Steps of more than 16 rows multiply FP8 weights on the H200's FP8 tensor cores (torch's blockwise
scaled_mm, hf_paged/quantization/fp8_weights.py), which needs the activations in float8_e4m3fn
too, with one float32 scale per row and block of 128 columns (block amax / 448), stored M-major
([M, K / 128] with strides (1, M): the layout cuBLASLt reads). In torch that is ~8 launches per
linear layer (views, abs, amax, division, clamp, cast, transposes): 1,800 a decode step at the
Llama-3-8B shape. Here one program quantises one row, all of its blocks at once.

`quantize_rows_ref` is the same in torch (the reference of the tests). Rows past `rows` (the
padding cuBLASLt needs: a multiple of 16) come out as zeros with the smallest scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_gemv import SCALE_BLOCK as BLOCK  # the weights' blocks: one scale per 128 columns
from .host_math import next_power_of_2
from .kv_write import FP8_MAX as _FP8_LIMITS
from .kv_write import check_launchable

FP8_MAX = _FP8_LIMITS[torch.float8_e4m3fn]  # its largest finite value, 448
MIN_SCALE = 1e-12


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32
    q_ptr,  # float8_e4m3fn [M_PAD, K]
    s_ptr,  # float32 [M_PAD, K / BLOCK], any strides
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sk,
    NUM_BLOCKS: tl.constexpr,  # next power of 2 of K / BLOCK
    BLOCK_K: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    m = tl.program_id(0)
    offs_b = tl.arange(0, NUM_BLOCKS)
    offs_c = tl.arange(0, BLOCK_K)
    cols = offs_b[:, None] * BLOCK_K + offs_c[None, :]  # [NUM_BLOCKS, BLOCK_K]
    in_row = cols < K
    real = (cols * 0 + m) < M  # as a tensor: the interpreter makes tensor & scalar bool int32
    x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + cols, mask=in_row & real, other=0.0)
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_MAX, MIN_SCALE)  # [NUM_BLOCKS]
    q = tl.minimum(tl.maximum(x / scale[:, None], -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + m.to(tl.int64) * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=in_row)
    s_ok = offs_b * BLOCK_K < K
    tl.store(s_ptr + m * stride_sm + offs_b * stride_sk, scale, mask=s_ok)


def quantize_rows(x: torch.Tensor, padded_rows: int | None = None):
    """(float8_e4m3fn [P, K], float32 scales [P, K / 128] M-major) of x [M, K], K a multiple of
    128, P = padded_rows (>= M; default M): rows past M zero."""
    if x.dim() != 2 or x.shape[1] % BLOCK or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with K a multiple of {BLOCK}, contiguous in K")
    m, k = x.shape
    p = m if padded_rows is None else padded_rows
    if p < m:
        raise ValueError(f"padded_rows {p} is fewer than x's {m} rows")
    check_launchable(x, "x")
    q = torch.empty((p, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((k // BLOCK, p), dtype=torch.float32, device=x.device).t()
    if p:
        _quantize_rows_kernel[(p,)](
            x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
            NUM_BLOCKS=next_power_of_2(k // BLOCK),
            BLOCK_K=BLOCK,
            FP8_MAX=FP8_MAX,
            MIN_SCALE=MIN_SCALE,
            num_warps=4,
        )  # fmt: skip
    return q, scales


def quantize_rows_ref(x: torch.Tensor, padded_rows: int | None = None):
    """quantize_rows in torch."""
    m, k = x.shape
    p = m if padded_rows is None else padded_rows
    if p > m:
        x = torch.cat([x, x.new_zeros(p - m, k)])
    xb = x.view(p, k // BLOCK, BLOCK).float()
    scale = (xb.transpose(0, 1).abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE).t()
    q = (xb / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(p, k)
    return q, scale
