"""y = x @ weight.T for a few rows on tensor cores (fused_gemv sends it 3-8), neighbours fused in.

fused_gemv holds a program's whole [BLOCK_N, K] weight tile in registers and computes the rows
one after another on the CUDA cores: the fastest way at 1-2 rows, but each further row costs a
full pass of multiply-adds and a cross-thread reduction over the tile, so a 6-token step of the
Llama-3-8B shape took ~18.7 ms against ~4.6 through transformers' forward (cuBLAS, H200). That
is the size of a speculative verify step (k + 1 tokens) and of batch 3-8 decode. Here a program
owns BLOCK_N output columns for all rows and walks K in BLOCK_K tiles: each weight tile is read
once (evict-first, as fused_gemv's) and multiplied with the rows' [BLOCK_M, BLOCK_K] tile by
tl.dot (rows padded to 16, the smallest tensor-core tile), so the rows cost tensor-core time,
not CUDA-core time; the weight stream is pipelined by Triton (num_stages).

The same options as fused_gemv, computed and rounded the same way (fused_gemv_ref is the
reference of both): NORM / NORM_PLUS_ONE (each row's 1 / rms in a first pass over x, then each
x tile normalised as it is loaded), GATED (two accumulators, act(gate) * up), HAS_BIAS,
RESIDUAL, GATHER, NORM_OUT, PDL. Not here: FP8 weights and LoRA epilogues (fused_gemv keeps
those at every row count).

float32 inputs use IEEE float32 products (tl.dot would otherwise take TF32 on the GPU), so a
float32 model's greedy output stays that of transformers' float32 forward.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gemv_math import gate_activation, rms_scale
from .host_math import cdiv, next_power_of_2
from .kv_write import check_launchable, interpreting

try:  # Triton >= 3.3 (fused_gemv.py says which)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

MIN_BLOCK_M = 16  # tl.dot's smallest tile side


@triton.jit
def _x_tile(x_ptr, x_rows, m_mask, stride_xm, offs_k, k_mask):
    # the rows' [BLOCK_M, BLOCK_K] tile of x (rows past M read as 0: their products are not
    # stored)
    ptrs = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    return tl.load(ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _w_tile(w_ptr, stride_wn, offs_n, n_mask, offs_k, k_mask):
    # read once a step and far larger than L2: evict-first (fused_gemv.load_weights says why)
    ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # acc + x @ w.T. The interpreter of Triton 3.9 multiplies bfloat16 tiles wrongly (values
    # of 1e10 for unit inputs): there the product is of exact float32 copies, which is what the
    # tensor cores compute (bf16 products are exact in float32, summed in float32)
    if UPCAST:
        return tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w), acc)


@triton.jit(do_not_specialize=["M"])
def _fused_gemm_rows_kernel(
    x_ptr,
    rows_ptr,
    nw_ptr,
    w_ptr,
    w2_ptr,
    b_ptr,
    r_ptr,
    y_ptr,
    no_ptr,  # [M, K] the normalised rows (NORM_OUT)
    M,
    N,
    eps,
    stride_xm,
    stride_wn,
    stride_w2n,
    stride_rm,
    stride_ym,
    stride_nom,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    NORM_PLUS_ONE: tl.constexpr,
    GATED: tl.constexpr,
    GELU_TANH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATHER: tl.constexpr,
    NORM_OUT: tl.constexpr,
    PDL: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: IEEE products, not TF32
    UPCAST: tl.constexpr,  # bf16 on the CPU interpreter: products of float32 copies
):
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    dt = y_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()  # x, rows and the residual come from earlier kernels
    if GATHER:
        x_rows = tl.load(rows_ptr + offs_m, mask=m_mask, other=0)
    else:
        x_rows = offs_m
    if NORM:  # each row's 1 / rms first: every x tile of the product is normalised
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xf = _x_tile(x_ptr, x_rows, m_mask, stride_xm, offs_k, offs_k < K).to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
        inv_rms = 1.0 / tl.sqrt(sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = _x_tile(x_ptr, x_rows, m_mask, stride_xm, offs_k, k_mask)
        if NORM:  # as fused_gemv (and transformers' RMSNorm modules) round
            g = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = rms_scale(x.to(tl.float32) * inv_rms[:, None], g[None, :], dt, NORM_PLUS_ONE)
            if NORM_OUT:  # every program normalised the rows: the first one writes them
                if pid == 0:
                    no_ptrs = no_ptr + offs_m[:, None] * stride_nom + offs_k[None, :]
                    tl.store(no_ptrs, x, mask=m_mask[:, None] & k_mask[None, :])
        if UPCAST:
            x = x.to(tl.float32)
        acc = _dot(x, _w_tile(w_ptr, stride_wn, offs_n, n_mask, offs_k, k_mask), acc, IEEE,
                   UPCAST)  # fmt: skip
        if GATED:
            w2 = _w_tile(w2_ptr, stride_w2n, offs_n, n_mask, offs_k, k_mask)
            acc2 = _dot(x, w2, acc2, IEEE, UPCAST)
    y = acc
    if HAS_BIAS:
        y += bias[None, :]
    if GATED:
        gate = y.to(dt).to(tl.float32)
        act = gate_activation(gate, GELU_TANH).to(dt).to(tl.float32)
        y = act * acc2.to(dt).to(tl.float32)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if RESIDUAL:
        res = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_mask,
                      other=0.0)  # fmt: skip
        y = res.to(tl.float32) + y.to(dt).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(dt), mask=out_mask)


@functools.cache
def gemm_rows_config(k: int, gated: bool, norm: bool) -> dict:
    """Tile and pipeline depth on a GPU: 32 output columns and 256 of K a program step; three
    stages for the two weight tiles of a gated product, four where x is normalised as it is
    loaded, six otherwise. H100, Llama-3-8B shapes, 6 rows, the fastest of 27 tiles (BLOCK_N
    16/32/64 x BLOCK_K 64/128/256 x 3/4/6 stages, `evals/profiling/gemm_rows_bench.py --sweep
    6`): each of these is first or within 2.5% of it (q/k/v 28.6 us, o 15.9, gate/up 96.5,
    down 44.2), against 56.5, 19.6, 127.0 and 59.0 for 16-32 columns by 128 of K."""
    stages = 3 if gated else 4 if norm else 6
    return dict(BLOCK_N=32, BLOCK_K=min(256, max(16, next_power_of_2(k))), num_warps=4,
                num_stages=stages)  # fmt: skip


def fused_gemm_rows(
    x: torch.Tensor,  # [R, K]
    weight: torch.Tensor,  # [N, K]
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    up_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    norm_out: torch.Tensor | None = None,
    norm_plus_one: bool = False,
    activation: str = "silu",
    pdl: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """fused_gemv_ref(...) (no FP8 weights, no LoRA) by one tensor-core launch. The checks of
    the arguments are fused_gemv's, which routes its calls of more than 2 rows here: call that."""
    m = x.shape[0] if rows is None else rows.shape[0]
    n, k = weight.shape
    check_launchable(x, "x")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    gated = up_weight is not None
    if config is None:
        cfg = dict(gemm_rows_config(k, gated, norm_weight is not None))
    else:
        cfg = dict(config)
    if interpreting() and config is None:  # few wide programs on the CPU (fused_gemv says why)
        cfg["BLOCK_N"] = min(64, max(16, next_power_of_2(n)))
    block_n = cfg.pop("BLOCK_N")
    if pdl:
        cfg["launch_pdl"] = True
    _fused_gemm_rows_kernel[(cdiv(n, block_n),)](
        x,
        rows if rows is not None else x,
        norm_weight if norm_weight is not None else weight,
        weight,
        up_weight if gated else weight,
        bias if bias is not None else weight,
        residual if residual is not None else y,
        y,
        norm_out if norm_out is not None else y,
        m,
        n,
        float(eps),
        x.stride(0),
        weight.stride(0),
        (up_weight if gated else weight).stride(0),
        (residual if residual is not None else y).stride(0),
        y.stride(0),
        (norm_out if norm_out is not None else y).stride(0),
        K=k,
        BLOCK_M=max(MIN_BLOCK_M, next_power_of_2(m)),
        BLOCK_N=block_n,
        NORM=norm_weight is not None,
        NORM_PLUS_ONE=norm_plus_one,
        GATED=gated,
        GELU_TANH=activation == "gelu_tanh",
        HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None,
        GATHER=rows is not None,
        NORM_OUT=norm_out is not None,
        PDL=pdl,
        IEEE=x.dtype == torch.float32,
        UPCAST=interpreting() and x.dtype == torch.bfloat16,
        **cfg,
    )
    return y
