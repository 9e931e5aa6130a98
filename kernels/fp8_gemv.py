"""FP8 weight-only matrix products for a few rows (small-batch decode).

`fp8_gemv(x, weight, scale, bias)` computes x @ W.T (+ bias) for a float8_e4m3fn weight [N, K]
with float32 block scales [N, ceil(K / 128)] (W[n, k] = weight[n, k] * scale[n, k // 128]),
reading each weight byte once: at batch 1-16 a linear layer is bound by the weight bytes it
streams, and FP8 halves them against bf16. Each K step is one 128-column block: the weight tile is
cast to the activations' dtype in registers, multiplied with tl.dot, and the partial sums are
multiplied by the block's scale (one per output row, so it factors out of the block's sum over
K) before they are accumulated. `fp8_gemv_ref` is the same product in torch (the CPU path and
the tests' reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_write import check_launchable, interpreting

MAX_ROWS = 16
SCALE_BLOCK = 128  # input columns per scale (hf_paged/quantization/fp8_weights.py)


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


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # float8 [N, K]
    scale_ptr,  # f32 [N, ceil(K / BLOCK_K)]
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # one program: BLOCK_N output channels for every row (M <= BLOCK_M), looping over K one
    # scale block (BLOCK_K columns) at a time
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
        s = tl.load(scale_ptr + offs_n * stride_sn + (k0 // BLOCK_K) * stride_sk, mask=n_ok)
        acc += part * s[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    scale: torch.Tensor,  # float32 [N, ceil(K / 128)], any strides
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N]
    """Triton version of `fp8_gemv_ref` for at most MAX_ROWS rows."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {x.shape} and {weight.shape}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"fp8_gemv takes 1 to {MAX_ROWS} rows, got {x.shape[0]}")
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise ValueError(f"weight must be float8_e4m3fn and scale float32, got {weight.dtype}")
    n, k = weight.shape
    blocks = triton.cdiv(k, SCALE_BLOCK)
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
    upcast = interpreting() and x.dtype == torch.bfloat16  # the interpreter's bf16 dot: raw bits
    xk = x.float() if upcast else x
    block_n = 64 if n >= 4096 else 32
    grid = (triton.cdiv(n, block_n),)
    _fp8_gemv_kernel[grid](
        xk,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        xk.stride(0),
        weight.stride(0),
        scale.stride(0),
        scale.stride(1),
        out.stride(0),
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=SCALE_BLOCK,
        HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if xk.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out
