"""RMSNorm -> q/k/v projection -> RoPE -> K/V cache write, in one launch (a handful of rows).

The small-batch forward's first two launches per layer (fused_gemv NORM, then rope_write_kv) as
one: each program owns P rotary pairs of one head, i.e. the 2P weight rows (j, j + D/2) that
rotate together, so it can rotate its own outputs. Query heads go to a [T, Hq, D] output, key
heads (rotated) and value heads go straight to their cache slot; the projection's output never
makes a round trip through memory, and a ~2 us launch per layer goes away.

cos/sin come from tables over positions, [max_positions, D/2] (the rotate-half convention's
tables repeat after D/2 columns: `SmallBatchForward` checks that before using this kernel), read
at each row's position. Rounding follows transformers op by op, as fused_gemv and rope_write_kv do.

LoRA on q/k/v (lora: kernels/lora_epilogue.py::LoraEpilogue of the group's shrink of x * norm
weight): each row's delta is added to the projection before RoPE and the cache write, as
fused_gemv's epilogue adds it, so adapters keep this one launch (after their shrink).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_gemv import (
    MAX_ROWS,
    _row_mask,
    fused_gemv_ref,
    gdc_launch_dependents,
    gdc_wait,
    load_block_scales,
    load_weight_tile,
    weight_dot,
)
from .gemv_math import rms_scale
from .gemv_tiles import ELEMS_PER_THREAD, MAX_WARPS, fp8_tile_config
from .host_math import next_power_of_2
from .kv_write import check_kv_cache_pair, check_launchable, interpreting
from .lora_epilogue import (
    LoraEpilogue,
    lora_launch_args,
    lora_prefetch,
    lora_row_delta,
    lora_s_row,
)
from .rope_kv import rope_write_kv_ref, rotate_halves


def norm_qkv_rope_ref(
    x, weight, bias, norm_weight, eps, positions, cos_table, sin_table,
    key_cache, value_cache, slot_mapping, num_q_heads, weight_scale=None, lora=None,
):  # fmt: skip
    """fused_gemv_ref (NORM, with the LoRA deltas) then rope_write_kv_ref, cos/sin gathered
    from the half tables."""
    qkv = fused_gemv_ref(
        x, weight, norm_weight=norm_weight, eps=eps, bias=bias, weight_scale=weight_scale,
        lora=lora,
    )  # fmt: skip
    cos = cos_table[positions].repeat(1, 2)
    sin = sin_table[positions].repeat(1, 2)
    return rope_write_kv_ref(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_q_heads)


@triton.jit(do_not_specialize=["M", "stride_lss"])
def _norm_qkv_rope_kernel(
    x_ptr,  # [M, K] residual stream
    nw_ptr,  # [K] RMSNorm weight
    w_ptr,  # [(Hq + 2 Hkv) * D, K]
    ws_ptr,  # float32 block scales of w (SCALED: FP8 weights)
    b_ptr,  # [(Hq + 2 Hkv) * D] (HAS_BIAS)
    pos_ptr,  # int64 [M]
    cos_ptr,  # [max_positions, HALF]
    sin_ptr,
    q_ptr,  # [M, Hq, D] out
    kc_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    vc_ptr,
    slot_ptr,  # int64 [M]
    ls_ptr,  # f32 [LORA_SPLIT, M, 3 * R] the rows' LoRA shrink of x * g (LORA)
    lb_ptr,  # [S, (Hq + 2 Hkv) * D, R] the group's B
    lsc_ptr,  # f32 [3, S]
    lslot_ptr,  # int32 [M] each row's adapter slot, -1: none
    M,
    eps,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_cos,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    LORA_SPLIT,
    stride_lss,
    stride_lsm,
    stride_lbs,
    stride_lbn,
    stride_lsc,
    LORA_E0,  # the end rows of q and of k
    LORA_E1,
    LORA_R,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,  # rotary pairs per program (HALF % PAIRS == 0: one head per program)
    HALF: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    SCALED: tl.constexpr,
    LORA: tl.constexpr,
    LORA_SPLIT_PAD: tl.constexpr,
    LORA_SR_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    dt = q_ptr.dtype.element_ty
    first = pid * PAIRS
    head = first // HALF  # every pair of this program is in one head
    offs_j = first % HALF + tl.arange(0, PAIRS)  # column within the head's first half
    rows1 = head * 2 * HALF + offs_j
    rows2 = rows1 + HALF
    offs_k = tl.arange(0, K_PAD)
    k_mask = offs_k < K
    tile = offs_k[None, :] + tl.zeros([PAIRS, 1], dtype=tl.int32)  # [PAIRS, K_PAD]
    w1 = load_weight_tile(w_ptr + rows1.to(tl.int64)[:, None] * stride_wn + tile, tile < K, SCALED)
    w2 = load_weight_tile(w_ptr + rows2.to(tl.int64)[:, None] * stride_wn + tile, tile < K, SCALED)
    s1 = 1.0  # FP8 weights: the rows' block scales
    s2 = 1.0
    if SCALED:
        every = rows1 >= 0
        s1 = load_block_scales(ws_ptr, rows1, every, stride_wsn, stride_wsk, K, K_PAD)
        s2 = load_block_scales(ws_ptr, rows2, every, stride_wsn, stride_wsk, K, K_PAD)
    g = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b1 = tl.load(b_ptr + rows1).to(tl.float32)
        b2 = tl.load(b_ptr + rows2).to(tl.float32)
    # Each row's position, cos / sin and cache slot are step inputs the host copied before the
    # step's first launch, which is an ordinary one (kernels/embedding.py): nothing in this PDL
    # chain writes them, so they are read before the wait too. Read after the GEMV they would
    # add two dependent loads (position, then cos / sin) and a third (slot) to every layer's
    # critical path.
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0)
    cs_off = pos[:, None] * stride_cos + offs_j[None, :]  # [BLOCK_M, PAIRS]
    cos = tl.load(cos_ptr + cs_off).to(tl.float32)
    sin = tl.load(sin_ptr + cs_off).to(tl.float32)
    slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1)
    if LORA:  # the adapters' slots, B and scales likewise (lora_prefetch)
        every = rows1 >= 0
        l_slots, l_b1, l_sc1 = lora_prefetch(lb_ptr, stride_lbs, stride_lbn, lsc_ptr, stride_lsc,
                                             lslot_ptr, M, rows1, every, LORA_E0, LORA_E1,
                                             LORA_R, 0, 3, BLOCK_M, LORA_SR_PAD)  # fmt: skip
        _, l_b2, l_sc2 = lora_prefetch(lb_ptr, stride_lbs, stride_lbn, lsc_ptr, stride_lsc,
                                       lslot_ptr, M, rows2, every, LORA_E0, LORA_E1, LORA_R, 0,
                                       3, BLOCK_M, LORA_SR_PAD)  # fmt: skip
    if PDL:
        gdc_wait()  # x comes from the previous kernel
    # the projection's outputs of every row, in the model dtype (as f32): [BLOCK_M, PAIRS]
    y1s = tl.zeros([BLOCK_M, PAIRS], dtype=tl.float32)
    y2s = tl.zeros([BLOCK_M, PAIRS], dtype=tl.float32)
    # row m + 1's x is loaded before row m is computed (a masked load, no branch), as in
    # fused_gemv: behind a runtime check it waited for the row before
    x_next = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    if LORA:  # the shrink's output, from the previous kernel: loaded with x
        ls_next = lora_s_row(ls_ptr, 0, M, LORA_SPLIT, stride_lss, stride_lsm, 3 * LORA_R,
                             LORA_SPLIT_PAD, LORA_SR_PAD)  # fmt: skip
    for m in tl.static_range(BLOCK_M):
        x_raw = x_next
        if LORA:
            ls_row = ls_next
        if m + 1 < BLOCK_M:
            row_mask = _row_mask(k_mask, offs_k, m + 1, M)
            x_next = tl.load(x_ptr + (m + 1) * stride_xm + offs_k, mask=row_mask, other=0.0)
            if LORA:
                ls_next = lora_s_row(ls_ptr, m + 1, M, LORA_SPLIT, stride_lss, stride_lsm,
                                     3 * LORA_R, LORA_SPLIT_PAD, LORA_SR_PAD)  # fmt: skip
        if m == 0 or m < M:  # M >= 1 (the host returns early on 0): row 0 needs no check
            x = x_raw.to(tl.float32)
            inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
            x = rms_scale(x * inv_rms, g, dt, False).to(tl.float32)
            y1 = weight_dot(w1, x, s1, SCALED, K_PAD)
            y2 = weight_dot(w2, x, s2, SCALED, K_PAD)
            if HAS_BIAS:
                y1 += b1
                y2 += b2
            if LORA:  # the deltas before RoPE: rounded product + delta, rounded (as peft)
                ldt = lb_ptr.dtype.element_ty
                d1, adapted = lora_row_delta(l_slots, l_b1, l_sc1, ls_row, m, inv_rms, ldt)
                d2, _ = lora_row_delta(l_slots, l_b2, l_sc2, ls_row, m, inv_rms, ldt)
                y1 = y1.to(dt).to(tl.float32)
                y2 = y2.to(dt).to(tl.float32)
                y1 = tl.where(adapted, (y1 + d1).to(dt).to(tl.float32), y1)
                y2 = tl.where(adapted, (y2 + d2).to(dt).to(tl.float32), y2)  # fmt: skip
            row = (offs_m == m)[:, None]
            y1s = tl.where(row, y1.to(dt).to(tl.float32)[None, :], y1s)
            y2s = tl.where(row, y2.to(dt).to(tl.float32)[None, :], y2s)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:  # q or k: rotate (x * cos + rotate_half * sin)
        o1, o2 = rotate_halves(y1s, y2s, cos, cos, sin, sin, dt)
    else:
        o1 = y1s.to(dt)
        o2 = y2s.to(dt)
    if head < NUM_Q_HEADS:
        out = q_ptr + ((offs_m * NUM_Q_HEADS + head) * 2 * HALF)[:, None] + offs_j[None, :]
        tl.store(out, o1, mask=m_ok[:, None])
        tl.store(out + HALF, o2, mask=m_ok[:, None])
    else:
        write = (m_ok & (slot >= 0))[:, None]  # slot -1: padding, nothing written
        block_id = slot // PAGE_SIZE
        block_off = slot % PAGE_SIZE
        cdt = kc_ptr.dtype.element_ty  # value_cache: the same (check_kv_cache_pair)
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            j = head - NUM_Q_HEADS
            c = kc_ptr + block_id * stride_kc_b + block_off * stride_kc_s + j * stride_kc_h
        else:
            j = head - NUM_Q_HEADS - NUM_KV_HEADS
            c = vc_ptr + block_id * stride_vc_b + block_off * stride_vc_s + j * stride_vc_h
        tl.store(c[:, None] + offs_j[None, :], o1.to(cdt), mask=write)
        tl.store(c[:, None] + HALF + offs_j[None, :], o2.to(cdt), mask=write)


def qkv_rope_config(k: int, half: int, itemsize: int = 2) -> dict | None:
    """Pairs per program and warps so the two [PAIRS, K] weight tiles stay in registers (FP8
    weights, itemsize 1: gemv_tiles.fp8_tile_config, a pair being two rows)."""
    if itemsize == 1:
        cfg = fp8_tile_config(k, gated=False, rows_per_unit=2)
        if cfg is None:
            return None
        pairs = cfg.pop("BLOCK_N")
        while half % pairs:
            pairs //= 2
        return dict(PAIRS=pairs, **cfg)
    k_pad = next_power_of_2(k)
    for pairs in (2, 1):
        if half % pairs:
            continue
        warps = max(4, 2 * pairs * k_pad // (32 * ELEMS_PER_THREAD))
        if warps <= MAX_WARPS:
            return dict(PAIRS=pairs, num_warps=warps)
    return None


def norm_qkv_rope(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K]
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    positions: torch.Tensor,  # int64 [T]
    cos_table: torch.Tensor,  # [max_positions, D / 2]
    sin_table: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
    num_q_heads: int,
    *,
    weight_scale: torch.Tensor | None = None,  # FP8 weight: float32 [N, ceil(K / 128)]
    pdl: bool = False,
    lora: LoraEpilogue | None = None,  # q/k/v's deltas: 3 slices, s of x * norm_weight
    config: dict | None = None,  # the tile (PAIRS, num_warps): qkv_rope_config's by default
) -> torch.Tensor:  # rotated queries [T, Hq, D]
    """norm_qkv_rope_ref by one Triton launch, for at most MAX_ROWS tokens."""
    check_kv_cache_pair(key_cache, value_cache)
    num_kv_heads, head_dim = key_cache.shape[2:]
    t, k = x.shape
    half = head_dim // 2
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"key_cache {key_cache.dtype} and value_cache {value_cache.dtype} differ")
    scaled = weight.dtype == torch.float8_e4m3fn
    w_dtype = weight.dtype if scaled else x.dtype
    if weight.shape != (n, k) or weight.stride(1) != 1 or weight.dtype != w_dtype:
        raise ValueError(f"weight must be [{n}, {k}] of {x.dtype}, got {list(weight.shape)}")
    if scaled != (weight_scale is not None):
        raise ValueError("weight_scale goes with a float8_e4m3fn weight, and only with one")
    if scaled and (
        tuple(weight_scale.shape) != (n, -(-k // 128)) or weight_scale.dtype != torch.float32
    ):
        raise ValueError(f"weight_scale must be float32 [{n}, {-(-k // 128)}]")
    if t > MAX_ROWS:
        raise ValueError(f"norm_qkv_rope takes at most {MAX_ROWS} tokens, got {t}")
    if head_dim & (head_dim - 1) or head_dim < 2:
        raise ValueError(f"head_dim must be a power of 2, got {head_dim}")
    for name, tab in (("cos_table", cos_table), ("sin_table", sin_table)):
        if tab.dim() != 2 or tab.shape[1] != half or tab.stride(1) != 1:
            raise ValueError(f"{name} must be [max_positions, {half}], got {list(tab.shape)}")
    if sin_table.stride(0) != cos_table.stride(0):
        raise ValueError("cos_table and sin_table must have one row stride")
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.shape != (t,) or idx.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{t}], got {idx.dtype} {list(idx.shape)}")
    cfg = dict(config) if config is not None else qkv_rope_config(k, half, weight.element_size())
    if cfg is None:
        raise ValueError(f"in_features {k}: the weight tile does not fit in registers")
    check_launchable(x, "x")
    widths = (num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    if lora is not None and (tuple(lora.slices) != widths or not lora.rms):
        raise ValueError(
            f"lora: slices must be q/k/v's {widths} and s of x * norm_weight (rms), got "
            f"{tuple(lora.slices)} rms={lora.rms}"
        )
    lora_args = lora_launch_args(lora, t, n, False, False, x.device)
    q = torch.empty((t, num_q_heads, head_dim), dtype=x.dtype, device=x.device)
    if t == 0:
        return q
    pairs = cfg.pop("PAIRS")
    if interpreting() and config is None:
        # the CPU interpreter runs programs one after another, each as numpy arrays: one program
        # a head instead of one per two pairs (same results; tile shapes only matter on a GPU)
        pairs = half
    if half % pairs:
        raise ValueError(f"config: PAIRS {pairs} must divide head_dim / 2 ({half})")
    if pdl:
        cfg["launch_pdl"] = True
    _norm_qkv_rope_kernel[(n // 2 // pairs,)](
        x,
        norm_weight,
        weight,
        weight_scale if scaled else q,
        bias if bias is not None else weight,
        positions,
        cos_table,
        sin_table,
        q,
        key_cache,
        value_cache,
        slot_mapping,
        *lora_args["pointers"][:2] if lora is not None else (q, q),
        *lora_args["pointers"][3:] if lora is not None else (q, q),
        t,
        float(eps),
        x.stride(0),
        weight.stride(0),
        *(weight_scale.stride() if scaled else (0, 0)),
        cos_table.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        *lora_args["scalars"],
        K=k,
        K_PAD=next_power_of_2(k),
        BLOCK_M=next_power_of_2(t),
        PAIRS=pairs,
        HALF=half,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        PAGE_SIZE=key_cache.shape[1],
        HAS_BIAS=bias is not None,
        PDL=pdl,
        SCALED=scaled,
        LORA=lora is not None,
        LORA_SPLIT_PAD=lora_args["split_pad"],
        LORA_SR_PAD=lora_args["sr_pad"],
        **cfg,
    )
    return q
