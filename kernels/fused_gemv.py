"""y = x @ weight.T for a handful of rows, with the decoder layer's neighbours fused in.

At batch 1 a decoder layer is four matrix-vector products (q/k/v, o, gate/up, down) and, between
them, a dozen tiny kernels (RMSNorms, residual adds, SiLU-mul, cuBLAS's split-K reduce), each
paying a launch and a ramp while HBM idles. Measured on the H200 (TinyLlama-1.1B shape,
2026-11-29): the layer's GEMVs take 35 us on cuBLAS against 21 us of weight reads, and the small
kernels another ~20 us. This kernel does one GEMV with, optionally:

- NORM: RMSNorm of x first (fp32 sum of squares, then as transformers' LlamaRMSNorm rounds:
  normalised x to the model dtype, times the norm weight in the model dtype);
  or as Gemma2RMSNorm computes it (NORM_PLUS_ONE: x * rsqrt(.) * (1 + w) in fp32, rounded once);
- GATED: act(x @ w.T) * (x @ w2.T), w2 being the up projection's rows (LlamaMLP's act * up), act
  SiLU or GELU with the tanh approximation (GELU_TANH: Gemma 2's gelu_pytorch_tanh);
- HAS_BIAS, RESIDUAL (y + residual, each rounded to the model dtype as torch would);
- GATHER: x's rows picked by an index tensor (the logits rows a step keeps);
- LORA: each row's LoRA delta (kernels/lora_epilogue.py::LoraEpilogue: the shrink's output and the
  stacked B read here) added to the product where peft adds it: after the bias, before the
  activation (gate and up each get theirs) and the residual. Its own B rows are all a program
  reads beyond the weights, so a projection's adapters cost one shrink launch and no expand;
- PDL (Hopper): programmatic dependent launch. The kernel lets the next one be scheduled as soon
  as all its programs run (griddepcontrol.launch_dependents), and waits for the previous kernel's
  results (griddepcontrol.wait) only when it first reads them, so launch and ramp overlap the
  previous kernel's tail.

Each program owns BLOCK_N output rows of the weight and holds them, whole K, in registers: their
loads are issued first, before the wait on the previous kernel. 22 layers of the 1.1B shape at
batch 1 in one CUDA graph (norm, SiLU-mul and residual fused in; H200, 2026-11-29): 27.1 us a
layer with PDL (77% of the H200's bandwidth), 31.9 without, against 37.5 for cuBLAS's GEMVs
alone; a kernel walking K in tiles instead took 40 us. Rows are computed one after another: at
4-8 rows this is slower than transformers' forward, so calls of more than ROW_SERIAL_ROWS rows
go to kernels/fused_gemm_rows.py (tensor cores), but those with FP8 weights or LoRA.
`fused_gemv_ref` is the same computation in torch (the CPU reference the kernel is tested
against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_gemm_rows import fused_gemm_rows
from .fused_gemv_ref import ACTIVATIONS, fused_gemv_ref, rms_norm_ref  # noqa: F401 (re-exported)
from .gemv_math import gate_activation, rms_scale
from .gemv_tiles import tile_config
from .host_math import cdiv, next_power_of_2
from .kv_write import check_launchable, interpreting
from .lora_epilogue import (
    MAX_ROWS,
    LoraEpilogue,
    lora_launch_args,
    lora_prefetch,
    lora_row_delta,
    lora_s_row,
)

try:  # Triton >= 3.3 (the GPU machine's 3.6 and CI's 3.9 have it)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off (pdl_available)
    gdc_launch_dependents = gdc_wait = None

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Up to this many rows the row-by-row kernel here; more go to the tensor-core kernel
# (fused_gemm_rows.py) where it has the options asked for (tensor_core_rows)
ROW_SERIAL_ROWS = 2


def tensor_core_rows(rows: int, weight_dtype: torch.dtype, lora) -> bool:
    """Whether fused_gemv computes these rows on fused_gemm_rows.py's tensor cores: more than
    ROW_SERIAL_ROWS of them, of float weights (not FP8) and without LoRA deltas, which only the
    row-by-row kernels here and in qkv_rope.py take. The small-batch forward asks it too, to
    know whether q/k/v should leave the one-launch norm_qkv_rope (row by row as well)."""
    return rows > ROW_SERIAL_ROWS and weight_dtype != torch.float8_e4m3fn and lora is None


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch needs sm_90+ and a compiled (not interpreted) kernel."""
    return (
        device.type == "cuda"
        and gdc_wait is not None
        and not interpreting()
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@triton.jit
def load_weights(ptrs, mask):
    # Weights are read once a step and are far larger than L2 (2 GB a token at the 1.1B
    # shape against 50 MB): marked evict-first, they pass through L2 without pushing out what
    # the next step reads again (the KV cache, the activations, the step inputs), so e.g.
    # decode attention's K/V tile, read while the weights of the next GEMVs stream, comes
    # from L2. Measured on the H200 (1.1B shape, batch 1, 2026-11-30, interleaved A/B):
    # 1,416-1,419 tok/s with the hint against 1,390-1,396 without; Llama-3-8B, at its
    # bandwidth bound either way, 257-258 against 255-257.
    return tl.load(ptrs, mask, 0.0, eviction_policy="evict_first")


@triton.jit
def load_weight_tile(ptrs, mask, SCALED: tl.constexpr):
    # 2-byte weights are converted to float32 at the load. FP8 weights (SCALED) stay float8 in
    # registers, four to a register, and are converted where weight_dot uses them: a thread
    # then holds 4x the weights a register budget allows as float32, so a program keeps more
    # of the HBM stream in flight (tile_config gives FP8 tiles 256 weights a thread). H200,
    # Llama-3-8B shape, batch 1, a one-off sweep of 8 layers a projection in one graph with
    # PDL (2026-12-03; its script and log are not kept): gate/up 29.5 us (3.98 TB/s) against
    # 37.9 for the best float32-at-load tile and 42.7 for the float32-at-load default; q/k/v
    # 8.6 against 10.0, o 6.0 against 6.1, down 18.4 against 19.3; decoding the codes by moving
    # bits instead of the hardware conversion was slower everywhere (gate/up 50.5 us). Kept
    # measurement, without PDL: `evals/profiling/fp8_gemv_bench.py`, at 1 row 0.58-0.72x the
    # bf16 kernel's time (evals/h200/fp8-products-llama-3-8b-2026-12-03.log).
    w = load_weights(ptrs, mask)
    if not SCALED:
        w = w.to(tl.float32)
    return w


@triton.jit
def load_block_scales(s_ptr, offs_n, n_mask, stride_sn, stride_sk, K: tl.constexpr,
                      K_PAD: tl.constexpr):  # fmt: skip
    # FP8 weights (hf_paged/quantization/fp8_weights.py): the float32 scales of rows offs_n,
    # one per 128-column block: [ROWS, K_PAD / 128] (padding blocks 0)
    BLOCK: tl.constexpr = 128 if K_PAD >= 128 else K_PAD
    NUM_BLOCKS: tl.constexpr = K_PAD // BLOCK
    offs_b = tl.arange(0, NUM_BLOCKS)
    s_mask = n_mask[:, None] & (offs_b < (K + 127) // 128)[None, :]
    s_offs = offs_n.to(tl.int64)[:, None] * stride_sn + offs_b[None, :] * stride_sk
    return tl.load(s_ptr + s_offs, mask=s_mask, other=0.0)


@triton.jit
def weight_dot(w, x, s, SCALED: tl.constexpr, K_PAD: tl.constexpr):
    # sum over k of w[n, k] * x[k]: [ROWS] in float32. FP8 weights: each 128-column block's
    # partial sum of codes * x, times the block's scale s [ROWS, K_PAD / 128] (one multiply a
    # block, not a weight; the same sum as scaling each weight, up to float32 rounding)
    if SCALED:
        BLOCK: tl.constexpr = 128 if K_PAD >= 128 else K_PAD
        NUM_BLOCKS: tl.constexpr = K_PAD // BLOCK
        p = tl.reshape(w.to(tl.float32) * x[None, :], [w.shape[0], NUM_BLOCKS, BLOCK])
        y = tl.sum(tl.sum(p, axis=2) * s, axis=1)
    else:
        y = tl.sum(w * x[None, :], axis=1)
    return y


@triton.jit
def _weight_tile(
    w_ptr, stride_wn, offs_n, offs_k, mask, K: tl.constexpr, ROWS_I32: tl.constexpr,
    SCALED: tl.constexpr,
):  # fmt: skip
    # rows back to back and under 2^31 elements (ROWS_I32): 32-bit offsets with K's stride
    # known; otherwise 64-bit offsets by the runtime row stride. A 2-byte weight's fp32
    # conversion sits here, right after the load, on purpose: converting at each row's use
    # instead (fewer registers at 2+ rows) compiled to a schedule 3% slower at 1 row and slower
    # at 2 (H200, 1.1B shape, 2026-11-30). FP8 weights are the other way round
    # (load_weight_tile says why).
    if ROWS_I32:
        offs = offs_n[:, None] * K + offs_k[None, :]
    else:
        offs = offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    return load_weight_tile(w_ptr + offs, mask, SCALED)


@triton.jit(do_not_specialize=["M", "stride_lss"])
def _fused_gemv_kernel(
    x_ptr,
    rows_ptr,
    nw_ptr,
    w_ptr,
    w2_ptr,
    ws_ptr,  # float32 block scales of w (SCALED: FP8 weights)
    w2s_ptr,  # and of w2
    b_ptr,
    r_ptr,
    y_ptr,
    no_ptr,  # [M, K] the normalised rows (NORM_OUT)
    ls_ptr,  # f32 [LORA_SPLIT, M, slices * R] the rows' LoRA shrink (LORA)
    lb_ptr,  # [S, N, R] B of the columns (GATED: of the gate rows)
    lb2_ptr,  # [S, N, R] GATED: B of the up rows
    lsc_ptr,  # f32 [slices, S]
    lslot_ptr,  # int32 [M] each row's slot, -1: none
    M,
    N,
    eps,
    stride_xm,
    stride_wn,
    stride_w2n,
    stride_wsn,
    stride_wsk,
    stride_w2sn,
    stride_w2sk,
    stride_rm,
    stride_ym,
    stride_nom,
    LORA_SPLIT,
    stride_lss,
    stride_lsm,
    stride_lbs,
    stride_lbn,
    stride_lsc,
    LORA_E0,  # the end column of slice 0, and of slice 1
    LORA_E1,
    LORA_R,
    K: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of 2
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NORM: tl.constexpr,
    NORM_PLUS_ONE: tl.constexpr,
    GATED: tl.constexpr,
    GELU_TANH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATHER: tl.constexpr,
    PDL: tl.constexpr,
    ROWS_I32: tl.constexpr,
    SCALED: tl.constexpr,
    NORM_OUT: tl.constexpr,
    LORA_SLICES: tl.constexpr,  # 0: no LoRA; GATED: 2 (gate, up)
    LORA_SPLIT_PAD: tl.constexpr,
    LORA_SR_PAD: tl.constexpr,
    LORA_RMS: tl.constexpr,  # the shrink took x * g: each row's delta input times 1 / rms
):
    # Each program holds its whole [BLOCK_N, K] weight tile in registers: the weight loads are
    # issued first, before the wait on the previous kernel (with PDL they stream while it
    # finishes) and before x's norm; then every row reuses the tile.
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    dt = y_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K_PAD)
    n_mask = offs_n < N
    k_mask = offs_k < K
    tile_mask = n_mask[:, None] & k_mask[None, :]
    w = _weight_tile(w_ptr, stride_wn, offs_n, offs_k, tile_mask, K, ROWS_I32, SCALED)
    ws = 1.0  # FP8 weights: the rows' block scales
    w2s = 1.0
    if GATED:
        w2 = _weight_tile(w2_ptr, stride_w2n, offs_n, offs_k, tile_mask, K, ROWS_I32, SCALED)
    if SCALED:
        ws = load_block_scales(ws_ptr, offs_n, n_mask, stride_wsn, stride_wsk, K, K_PAD)
        if GATED:
            w2s = load_block_scales(w2s_ptr, offs_n, n_mask, stride_w2sn, stride_w2sk, K, K_PAD)
    if NORM:
        g = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if LORA_SLICES:  # slots, B and scales before the wait (lora_prefetch says why)
        if GATED:  # gate rows: slice 0, up rows: slice 1
            l_slots, l_b, l_sc = lora_prefetch(lb_ptr, stride_lbs, stride_lbn, lsc_ptr,
                                               stride_lsc, lslot_ptr, M, offs_n, n_mask, LORA_E0,
                                               LORA_E1, LORA_R, 0, 1, BLOCK_M,
                                               LORA_SR_PAD)  # fmt: skip
            _, l_b2, l_sc2 = lora_prefetch(lb2_ptr, stride_lbs, stride_lbn, lsc_ptr, stride_lsc,
                                           lslot_ptr, M, offs_n, n_mask, LORA_E0, LORA_E1,
                                           LORA_R, 1, 1, BLOCK_M, LORA_SR_PAD)  # fmt: skip
        else:
            l_slots, l_b, l_sc = lora_prefetch(lb_ptr, stride_lbs, stride_lbn, lsc_ptr,
                                               stride_lsc, lslot_ptr, M, offs_n, n_mask, LORA_E0,
                                               LORA_E1, LORA_R, 0, LORA_SLICES, BLOCK_M,
                                               LORA_SR_PAD)  # fmt: skip
    if PDL:
        gdc_wait()  # x, rows and residual come from earlier kernels
    # row m + 1's inputs are loaded before row m is computed: with a runtime check around each
    # row, its loads could only start after the row before it was stored (one round trip a row)
    x_next, r_next = _row_inputs(x_ptr, rows_ptr, r_ptr, 0, M, stride_xm, stride_rm, offs_k,
                                 k_mask, offs_n, n_mask, GATHER, RESIDUAL)  # fmt: skip
    if LORA_SLICES:  # the shrink's output comes from the previous kernel: loaded with x
        ls_next = lora_s_row(ls_ptr, 0, M, LORA_SPLIT, stride_lss, stride_lsm,
                             LORA_SLICES * LORA_R, LORA_SPLIT_PAD, LORA_SR_PAD)  # fmt: skip
    for m in tl.static_range(BLOCK_M):
        x_raw, res = x_next, r_next
        if LORA_SLICES:
            ls_row = ls_next
        if m + 1 < BLOCK_M:
            x_next, r_next = _row_inputs(
                x_ptr, rows_ptr, r_ptr, m + 1, M, stride_xm, stride_rm, offs_k, k_mask, offs_n,
                n_mask, GATHER, RESIDUAL,
            )  # fmt: skip
            if LORA_SLICES:
                ls_next = lora_s_row(ls_ptr, m + 1, M, LORA_SPLIT, stride_lss, stride_lsm,
                                     LORA_SLICES * LORA_R, LORA_SPLIT_PAD,
                                     LORA_SR_PAD)  # fmt: skip
        if m == 0 or m < M:  # M >= 1 (the host returns early on 0): row 0 needs no check
            x = x_raw.to(tl.float32)
            row_scale = 1.0  # of the LoRA shrink's rows (LORA_RMS: x * g, not yet / rms)
            if NORM:
                inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
                if LORA_RMS:
                    row_scale = inv_rms
                x = rms_scale(x * inv_rms, g, dt, NORM_PLUS_ONE).to(tl.float32)
                if NORM_OUT:  # every program normalised the row: the first one writes it
                    if pid == 0:
                        tl.store(no_ptr + m * stride_nom + offs_k, x.to(dt), mask=k_mask)
            y = weight_dot(w, x, ws, SCALED, K_PAD)  # [BLOCK_N]
            if HAS_BIAS:
                y += bias
            if LORA_SLICES:  # rows of no adapter: B and scale zero, the delta not used
                ldt = lb_ptr.dtype.element_ty
                d, adapted = lora_row_delta(l_slots, l_b, l_sc, ls_row, m, row_scale, ldt)
                if GATED:
                    d2, _ = lora_row_delta(l_slots, l_b2, l_sc2, ls_row, m, row_scale, ldt)
                else:
                    # peft: the base product rounded, plus the delta, rounded again
                    y = y.to(dt).to(tl.float32)
                    y = tl.where(adapted, (y + d).to(dt).to(tl.float32), y)
            if GATED:
                gate = y.to(dt).to(tl.float32)
                if LORA_SLICES:
                    gate = tl.where(adapted, (gate + d).to(dt).to(tl.float32), gate)
                act = gate_activation(gate, GELU_TANH).to(dt).to(tl.float32)
                up = weight_dot(w2, x, w2s, SCALED, K_PAD).to(dt).to(tl.float32)
                if LORA_SLICES:
                    up = tl.where(adapted, (up + d2).to(dt).to(tl.float32), up)
                y = act * up
            if RESIDUAL:
                y = res.to(tl.float32) + y.to(dt).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + offs_n, y.to(dt), mask=n_mask)


@triton.jit
def _row_mask(mask, offs, m: tl.constexpr, M):
    # mask for row m of a tile's M rows (M >= 1, so row 0 needs no check); the row test as a
    # tensor: the interpreter turns a bool tensor & a Python bool into int32
    out = mask
    if m != 0:
        out = mask & ((offs * 0 + m) < M)
    return out


@triton.jit
def _row_inputs(x_ptr, rows_ptr, r_ptr, m: tl.constexpr, M, stride_xm, stride_rm, offs_k, k_mask,
                offs_n, n_mask, GATHER: tl.constexpr, RESIDUAL: tl.constexpr):  # fmt: skip
    # row m's x and residual (the residual with x: after the row sums it was a second round
    # trip), as masked loads without a branch
    x_mask = _row_mask(k_mask, offs_k, m, M)
    r_mask = _row_mask(n_mask, offs_n, m, M)
    if GATHER:
        if m == 0:
            x_row = tl.load(rows_ptr)
        else:
            x_row = tl.load(rows_ptr + m, mask=(tl.zeros([], tl.int32) + m) < M, other=0)
    else:
        x_row = m
    x = tl.load(x_ptr + x_row * stride_xm + offs_k, mask=x_mask, other=0.0)
    if RESIDUAL:
        res = tl.load(r_ptr + m * stride_rm + offs_n, mask=r_mask, other=0.0)
    else:
        res = x  # unused
    return x, res


def _rows_i32(w: torch.Tensor) -> bool:
    # 32-bit weight offsets with K's stride known where they fit. H200, 1.1B shape, batch 1
    # (2026-11-29, interleaved A/B): 1,279-1,283 tok/s against 1,271-1,273 with 64-bit offsets.
    return w.stride(0) == w.shape[1] and w.numel() < 2**31


def _check(name: str, t: torch.Tensor | None, shape: tuple, dtype: torch.dtype) -> None:
    if t is None:
        return
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {list(shape)} of {dtype}, got {list(t.shape)} {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")


def fused_gemv(
    x: torch.Tensor,  # [R, K]
    weight: torch.Tensor,  # [N, K]
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    up_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    up_scale: torch.Tensor | None = None,
    norm_out: torch.Tensor | None = None,
    norm_plus_one: bool = False,
    activation: str = "silu",
    pdl: bool = False,
    config: dict | None = None,
    lora: LoraEpilogue | None = None,
) -> torch.Tensor:
    """fused_gemv_ref(...) by one Triton launch, for at most MAX_ROWS output rows (rows picks
    them from x, else all of x's rows). FP8 weights (float8_e4m3fn) come with their float32
    block scales [N, ceil(K / 128)] (weight_scale, and up_scale with up_weight), any strides.
    norm_out [M, K] (with norm_weight, no rows): also receives RMSNorm(x), the input of the
    product (a LoRA delta of the same projection reads it instead of normalising again).
    lora: each row's LoRA delta added in the epilogue (no rows gather)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {list(x.shape)} and weight {list(weight.shape)}: in_features differ")
    dtype = x.dtype
    scaled = weight.dtype == torch.float8_e4m3fn
    w_dtype = weight.dtype if scaled else dtype
    if dtype not in _FLOAT_DTYPES or weight.dtype != w_dtype:
        raise ValueError(f"x ({dtype}) and weight ({weight.dtype}) must be one float dtype")
    n, k = weight.shape
    if scaled != (weight_scale is not None) or (up_weight is not None and scaled) != (
        up_scale is not None
    ):
        raise ValueError("weight_scale / up_scale go with float8_e4m3fn weights, and only them")
    for name, sc in (("weight_scale", weight_scale), ("up_scale", up_scale)):
        if sc is not None and (tuple(sc.shape) != (n, -(-k // 128)) or sc.dtype != torch.float32):
            raise ValueError(
                f"{name} must be float32 [{n}, {-(-k // 128)}], got {sc.dtype} {list(sc.shape)}"
            )
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64):
        raise ValueError(f"rows must be a 1-d int64 tensor, got {rows.dtype} {list(rows.shape)}")
    m = x.shape[0] if rows is None else rows.shape[0]
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if m > MAX_ROWS:
        raise ValueError(f"fused_gemv takes at most {MAX_ROWS} rows, got {m}")
    _check("weight", weight, (n, k), w_dtype)
    _check("up_weight", up_weight, (n, k), w_dtype)
    _check("norm_weight", norm_weight, (k,), dtype)
    _check("bias", bias, (n,), dtype)
    _check("residual", residual, (m, n), dtype)
    _check("norm_out", norm_out, (m, k), dtype)
    if norm_out is not None and (norm_weight is None or rows is not None):
        raise ValueError("norm_out needs norm_weight (and no rows)")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, strides {x.stride()}")
    check_launchable(x, "x")
    if lora is not None and lora.rms and norm_weight is None:
        raise ValueError("lora.rms (a shrink of x * norm_weight) needs norm_weight")
    if config is None and tensor_core_rows(m, weight.dtype, lora):
        # (a tile config given is this kernel's: the tests of its GPU tiles at 3+ rows)
        return fused_gemm_rows(
            x, weight, norm_weight=norm_weight, eps=eps, up_weight=up_weight, bias=bias,
            residual=residual, rows=rows, norm_out=norm_out, norm_plus_one=norm_plus_one,
            activation=activation, pdl=pdl,
        )  # fmt: skip
    gated = up_weight is not None
    lora_args = lora_launch_args(lora, m, n, gated, rows is not None, x.device)
    y = torch.empty((m, n), dtype=dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    nbytes = n * k * weight.element_size() * (2 if gated else 1)
    itemsize = weight.element_size()
    cfg = dict(config) if config is not None else tile_config(k, gated, nbytes, itemsize)
    if cfg is None:
        raise ValueError(f"in_features {k}: the weight tile does not fit in registers")
    if interpreting() and config is None:
        # the CPU interpreter runs programs one after another, each as numpy arrays: few wide
        # programs instead of many narrow ones (same results; tile shapes only matter on a GPU)
        cfg["BLOCK_N"] = min(64, next_power_of_2(n))
    block_n = cfg.pop("BLOCK_N")
    if pdl:
        cfg["launch_pdl"] = True
    _fused_gemv_kernel[(cdiv(n, block_n),)](
        x,
        rows if rows is not None else x,
        norm_weight if norm_weight is not None else weight,
        weight,
        up_weight if up_weight is not None else weight,
        weight_scale if scaled else y,
        up_scale if up_scale is not None else y,
        bias if bias is not None else weight,
        residual if residual is not None else y,
        y,
        norm_out if norm_out is not None else y,
        *lora_args["pointers"] or (y,) * 5,
        m,
        n,
        float(eps),
        x.stride(0),
        weight.stride(0),
        (up_weight if up_weight is not None else weight).stride(0),
        *(weight_scale.stride() if scaled else (0, 0)),
        *(up_scale.stride() if up_scale is not None else (0, 0)),
        (residual if residual is not None else y).stride(0),
        y.stride(0),
        (norm_out if norm_out is not None else y).stride(0),
        *lora_args["scalars"],
        K=k,
        K_PAD=next_power_of_2(k),
        BLOCK_M=next_power_of_2(m),
        BLOCK_N=block_n,
        NORM=norm_weight is not None,
        NORM_PLUS_ONE=norm_plus_one,
        GATED=up_weight is not None,
        GELU_TANH=activation == "gelu_tanh",
        HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None,
        GATHER=rows is not None,
        PDL=pdl,
        ROWS_I32=_rows_i32(weight) and (up_weight is None or _rows_i32(up_weight)),
        SCALED=scaled,
        NORM_OUT=norm_out is not None,
        LORA_SLICES=lora_args["slices"],
        LORA_SPLIT_PAD=lora_args["split_pad"],
        LORA_SR_PAD=lora_args["sr_pad"],
        LORA_RMS=lora is not None and lora.rms,
        **cfg,
    )
    return y
