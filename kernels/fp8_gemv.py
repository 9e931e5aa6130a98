"""FP8 weight-only matrix products for a few rows (small-batch decode).

`fp8_gemv(x, weight, scale, bias)` computes x @ W.T (+ bias) for a float8_e4m3fn weight [N, K]
with float32 block scales [N, ceil(K / 128)] (W[n, k] = weight[n, k] * scale[n, k // 128]),
reading each weight byte once: at batch 1-16 a linear layer is bound by the weight bytes it
streams, and FP8 halves them against bf16. Each K step is one 128-column block: the weight tile is
cast in registers, multiplied with tl.dot, and the partial sums are multiplied by the block's
scale (one per output row, so it factors out of the block's sum over K) before they are
accumulated. A product with few output channels splits K over several programs as well (a Llama
o projection has 4096 channels: 64 tiles of 64 cannot keep 132 SMs' loads in flight), whose
float32 partial sums a second launch adds in a fixed order. `fp8_gemv_ref` is the same product
in torch (the CPU path and the tests' reference).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .attention_config import num_sms
from .host_math import cdiv, next_power_of_2
from .kv_write import check_launchable, interpreting

MAX_ROWS = 16
SCALE_BLOCK = 128  # input columns per scale (hf_paged/quantization/fp8_weights.py)
REDUCE_BLOCK = 1024


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: weight[n, k] * scale[n, k // 128]."""
    return weight.float() * scale.repeat_interleave(SCALE_BLOCK, dim=1)[:, : weight.shape[1]]


def fp8_gemv_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # float8 [N, K]
    scale: torch.Tensor,  # float32 [N, ceil(K / 128)]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x's dtype
    w = dequantize_weight(weight, scale).to(x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


@functools.cache
def gemv_config(n: int, k: int, sms: int) -> dict:
    """BLOCK_N, K splits, warps and pipeline stages for an [N, K] FP8 weight on `sms` SMs.

    128 output channels a program (fewer where N is smaller), 4 warps, 3 stages; K split into
    the largest power of two of ranges that keeps about 4 programs a SM, each range at least
    4 blocks of 128 columns. H200, Llama-3-8B shapes, 8 rows, the best of 120 tiles (BLOCK_N
    16-128 x splits 1-16 x 4/8 warps x 3/4/6 stages) against this rule's choice
    (evals/h200/fp8-gemv-sweep-2026-12-04.log): q/k/v 14.6 us (8 splits: the rule's), o 12.5
    (8), gate/up 39.8 (2), down 24.7 (16); the previous tile (64 channels, no split) took
    35.7, 34.6, 59.0 and 106.0 us. Multiplying in bf16 instead of fp16 cost 15-38%."""
    block_n = max(16, min(128, next_power_of_2(n)))
    tiles = cdiv(n, block_n)
    blocks = cdiv(k, SCALE_BLOCK)
    splits = 1
    while splits * 2 * tiles <= 4 * sms and blocks >= splits * 2 * 4:
        splits *= 2
    return dict(BLOCK_N=block_n, splits=splits, num_warps=4, num_stages=3)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # float8 [N, K]
    scale_ptr,  # f32 [N, ceil(K / BLOCK_K)]
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N], or f32 [SPLITS, M, N] partial sums when SPLIT
    M,
    N,
    K,
    blocks_per_split,  # K blocks a program takes: its range is program_id(1)'s
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K a multiple of BLOCK_K: no column masks
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # write float32 partial sums for _fp8_gemv_reduce_kernel
    DOT_FP16: tl.constexpr,  # bf16 activations multiplied in fp16 (see the loop)
    DOT_PRECISION: tl.constexpr,
):
    # one program: BLOCK_N output channels for every row (M <= BLOCK_M) over one range of K
    # blocks (BLOCK_K columns, one scale each)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # rows past M and N read the last row (in bounds, never stored): no row masks in
    # the loop
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm
    s_rows = scale_ptr + tl.minimum(offs_n, N - 1) * stride_sn
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        k = kb * BLOCK_K + offs_k
        if EVEN_K:
            x = tl.load(x_rows + k[None, :])
            w = tl.load(w_rows + k[None, :])
        else:
            x = tl.load(x_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
        if DOT_FP16:
            # float8 -> fp16 is one conversion a pair of codes (-> bf16 is several); bf16
            # activations saturate at fp16's largest value
            x = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
            part = tl.dot(x, tl.trans(w.to(tl.float16)))
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
        acc += part * tl.load(s_rows + kb * stride_sk)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        part_ptrs = out_ptr + (pid_k * M + offs_m)[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemv_reduce_kernel(
    part_ptr,  # f32 [SPLITS, M, N]
    bias_ptr,
    out_ptr,  # [M, N]
    M,
    N,
    splits,
    stride_om,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # the split-K partial sums added in a fixed order (the same result on every run)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fp8_gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    scale: torch.Tensor,  # float32 [N, ceil(K / 128)], any strides
    bias: torch.Tensor | None = None,
    config: dict | None = None,  # gemv_config's keys (+ dot_fp16): a benchmark's tile
) -> torch.Tensor:  # [M, N]
    """Triton version of `fp8_gemv_ref` for at most MAX_ROWS rows."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {x.shape} and {weight.shape}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"fp8_gemv takes 1 to {MAX_ROWS} rows, got {x.shape[0]}")
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise ValueError(f"weight must be float8_e4m3fn and scale float32, got {weight.dtype}")
    n, k = weight.shape
    blocks = cdiv(k, SCALE_BLOCK)
    if scale.shape != (n, blocks):
        raise ValueError(
            f"scale must be [N={n}, ceil(K / {SCALE_BLOCK})={blocks}], got {scale.shape}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [N={n}], got {bias.shape}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    check_launchable(x, "x")
    m = x.shape[0]
    out = x.new_empty(m, n)
    cfg = dict(config or gemv_config(n, k, num_sms(x.device)))  # a copy: popped below
    splits = max(1, min(cfg.pop("splits"), blocks))
    per_split = cdiv(blocks, splits)
    splits = cdiv(blocks, per_split)  # no empty split
    dot_fp16 = cfg.pop("dot_fp16", True) and x.dtype == torch.bfloat16
    # the interpreter's bf16 dot multiplies raw bits: bf16 rows in float32 there
    xk = x.float() if interpreting() and x.dtype == torch.bfloat16 and not dot_fp16 else x
    parts = out if splits == 1 else torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    block_n = cfg.pop("BLOCK_N")
    _fp8_gemv_kernel[(cdiv(n, block_n), splits)](
        xk, weight, scale, bias if bias is not None else scale, parts,
        m, n, k, per_split,
        xk.stride(0), weight.stride(0), scale.stride(0), scale.stride(1), parts.stride(-2),
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=SCALE_BLOCK,
        EVEN_K=k % SCALE_BLOCK == 0,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        DOT_FP16=dot_fp16,
        DOT_PRECISION="ieee" if xk.dtype == torch.float32 else "tf32",
        **cfg,
    )  # fmt: skip
    if splits > 1:
        _fp8_gemv_reduce_kernel[(cdiv(m * n, REDUCE_BLOCK),)](
            parts, bias if bias is not None else scale, out, m, n, splits, out.stride(0),
            BLOCK=REDUCE_BLOCK,
            HAS_BIAS=bias is not None,
            num_warps=4,
        )  # fmt: skip
    return out
