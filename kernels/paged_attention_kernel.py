"""The general paged-attention Triton kernel: one q-tile of one sequence for one KV head.

_paged_attention_kernel serves every batch shape paged_attention launches (prefill-shaped and
decode-shaped tiles, flash-decoding splits, the zero-fill of unowned tokens); the cut of the work
and the launches are described in kernels/paged_attention.py, which sizes the grid and passes
the arguments. Held here with the device helpers only it uses: reading one paged K/V tile
through the block table (_load_kv_rows, _attend_kv_tile) and mapping a prefill-shaped program
to its sequence (_find_seq). The online-softmax step itself is shared with
decode_attention.py's kernel (attention_common.py); with splits, split_kv_reduce.py combines
the partials this kernel writes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import _accumulate_pv, _init_softmax_state, _softmax_step, fp16_query
from .fused_gemv import gdc_launch_dependents, gdc_wait


@triton.jit
def _load_kv_rows(
    ptrs,  # [BLOCK_N, HEAD_DIM_PAD]
    row_ok,  # [BLOCK_N] bool, used when MASK_ROWS
    offs_d,  # [HEAD_DIM_PAD]
    MASK_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    # Masks only where needed: an unmasked load of a power-of-2 head_dim is 16-byte vectorised.
    if MASK_ROWS:
        x = tl.load(ptrs, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_DIM != HEAD_DIM_PAD:
        x = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _attend_kv_tile(
    acc,  # f32 [BLOCK_M, HEAD_DIM_PAD], unnormalised output
    l_i,  # f32 [BLOCK_M], running softmax denominator
    m_i,  # f32 [BLOCK_M], running max (log2 units)
    q,  # [BLOCK_M, HEAD_DIM_PAD], query rows of the tile
    q_pos,  # int32 [BLOCK_M], absolute position of each row's token
    k_head_ptr,  # key cache at (block 0, slot 0, this kv head)
    v_head_ptr,  # value cache at (block 0, slot 0, this kv head)
    block_table_row_ptr,  # int32 [max_blocks], this sequence's physical block ids
    start_n,  # first key position of this tile
    seq_len,
    stride_kc_b,
    stride_kc_s,
    stride_vc_b,
    stride_vc_s,
    scale,
    softcap,
    sliding_window,
    offs_n,  # [BLOCK_N]
    offs_d,  # [HEAD_DIM_PAD]
    offs_dv,  # [HEAD_DIM_V_PAD]
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,  # FP8 K/V rows are cast to it (fp16_query says which)
    slopes=0.0,  # f32 [BLOCK_M] ALiBi slopes in log2 units (ALIBI only)
    ALIBI: tl.constexpr = False,
):
    k_idx = start_n + offs_n  # [BLOCK_N] key positions
    # Interior tiles lie wholly inside [0, seq_len): no bounds mask, so the loads vectorise fully.
    if MASKED:
        k_valid = k_idx < seq_len
        block_ids = tl.load(block_table_row_ptr + k_idx // PAGE_SIZE, mask=k_valid, other=0)
    else:
        k_valid = k_idx >= 0  # not read: _load_kv_rows ignores it when MASK_ROWS is False
        block_ids = tl.load(block_table_row_ptr + k_idx // PAGE_SIZE)
    in_page = (k_idx % PAGE_SIZE).to(tl.int64)
    block_ids = block_ids.to(tl.int64)  # int64: block_id * stride_b can pass 2^31
    k_off = block_ids * stride_kc_b + in_page * stride_kc_s  # [BLOCK_N] int64
    v_off = block_ids * stride_vc_b + in_page * stride_vc_s  # [BLOCK_N] int64
    k_ptrs = k_head_ptr + k_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
    v_ptrs = v_head_ptr + v_off[:, None] + offs_dv[None, :]  # [BLOCK_N, HEAD_DIM_V_PAD]
    k = _load_kv_rows(k_ptrs, k_valid, offs_d, MASKED, HEAD_DIM, HEAD_DIM_PAD)
    if k.dtype.is_fp8():  # an FP8 cache: the scales are applied by the caller (see paged_attention)
        k = k.to(COMPUTE_DTYPE)
    if MASKED:
        keep = k_idx[None, :] <= q_pos[:, None]
        if SLIDING:
            keep = keep & (k_idx[None, :] > q_pos[:, None] - sliding_window)
    else:
        keep = k_valid  # not read: unmasked tiles skip the mask
    if ALIBI:
        bias = slopes[:, None] * (k_idx[None, :] - q_pos[:, None]).to(tl.float32)
    else:
        bias = 0.0
    p, acc, l_i, m_new = _softmax_step(
        acc, l_i, m_i, q, k, keep, scale, softcap, MASKED, SOFTCAP, DOT_PRECISION, DOT_UPCAST,
        bias, ALIBI,
    )  # fmt: skip
    v = _load_kv_rows(v_ptrs, k_valid, offs_dv, MASKED, HEAD_DIM_V, HEAD_DIM_V_PAD)
    if v.dtype.is_fp8():
        v = v.to(COMPUTE_DTYPE)
    return _accumulate_pv(acc, p, v, DOT_PRECISION, DOT_UPCAST), l_i, m_new


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    # Sequence i owns programs [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): at least
    # cdiv(q_len_i, BLOCK_Q) of them, and the start is strictly increasing in i. Find the last i
    # whose start is <= pid (branchless binary search, ~log2(num_seqs) scalar loads).
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.zeros([], dtype=tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = start <= pid
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


# Per-step integers are not specialised: Triton would otherwise compile a new variant whenever one
# of them changes between 1, a multiple of 16 and anything else, which mid-run costs ~1 s a time.
# The block table's row stride is one of them: an eager step's table is as wide as its longest
# sequence needs, a graph's as wide as max_model_len, the start-up check's and warm-up's as their
# few blocks.
@triton.jit(
    do_not_specialize=[
        "num_seqs",
        "num_tokens",
        "num_tile_programs",
        "num_splits",
        "stride_bt_s",
        "stride_wo_t",
        "stride_wo_h",
        "stride_wl_t",
        "stride_wl_h",
    ]
)
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, Dv]
    ws_o_ptr,  # f32 [T, Hq, num_splits, HEAD_DIM_V_PAD] split partial outputs (SPLIT only)
    ws_lse_ptr,  # f32 [T, Hq, num_splits] split log2-sum-exp (SPLIT only)
    query_ptr,  # [T, Hq, D]
    key_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    value_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, Dv]
    block_table_ptr,  # int32 [num_seqs, max_blocks]
    seq_lens_ptr,  # int32 [num_seqs]
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    num_seqs,
    num_tokens,
    num_tile_programs,  # programs [0, num_tile_programs) compute, the rest zero-fill
    num_splits,
    sinks_ptr,  # f32 [Hq] attention sinks (SINKS only)
    scale,
    out_scale,  # FP8 caches: v_scale (1.0 otherwise)
    softcap,
    sliding_window,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_bt_s,
    stride_wo_t,
    stride_wo_h,
    stride_wo_s,
    stride_wl_t,
    stride_wl_h,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,  # a value head's width (out's last dim); MLA: != HEAD_DIM
    HEAD_DIM_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ZERO_TOKENS: tl.constexpr,
    ONE_TILE_PER_SEQ: tl.constexpr,
    Q_FILTER: tl.constexpr,  # 0: every sequence; 1: only q_len <= SHORT_Q; 2: only q_len > SHORT_Q
    SHORT_Q: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (see kernels/fused_gemv.py)
    alibi_ptr=None,  # f32 [Hq] ALiBi slopes (ALIBI only)
    ALIBI: tl.constexpr = False,
):
    if PDL:
        gdc_launch_dependents()  # the next kernel may be scheduled (and prefetch its weights)
        gdc_wait()  # q and the cache come from the previous kernel
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split_id = tl.program_id(2)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    d_mask = offs_d < HEAD_DIM
    if HEAD_DIM_V == HEAD_DIM:  # the usual case: one set of offsets, the code as before
        offs_dv = offs_d
        dv_mask = d_mask
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)  # [HEAD_DIM_V_PAD]
        dv_mask = offs_dv < HEAD_DIM_V

    if pid >= num_tile_programs:
        # Zero-fill ZERO_TOKENS flat tokens that no sequence owns, for this kv head's q heads.
        first_unowned = tl.load(query_start_loc_ptr + num_seqs)
        offs_z = (pid - num_tile_programs) * ZERO_TOKENS + tl.arange(0, ZERO_TOKENS)
        # Only split 0 writes. (A scalar bool & a vector mask yields ints in the interpreter.)
        z_end = tl.where(split_id == 0, num_tokens, 0)
        z_mask = (offs_z >= first_unowned) & (offs_z < z_end)
        z_ptr = out_ptr + offs_z.to(tl.int64)[:, None] * stride_o_t + offs_dv[None, :]
        zeros = tl.zeros([ZERO_TOKENS, HEAD_DIM_V_PAD], dtype=out_ptr.dtype.element_ty)
        for h in tl.static_range(QUERIES_PER_KV):
            head = kv_head * QUERIES_PER_KV + h
            tl.store(z_ptr + head * stride_o_h, zeros, mask=z_mask[:, None] & dv_mask[None, :])
        return

    # ---- which (sequence, q-tile) this program owns -----------------------------------------
    if ONE_TILE_PER_SEQ:
        seq = pid
        tile_in_seq = 0
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
        tile_in_seq = pid - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # Mixed batches run as two launches (decode-shaped and prefill-shaped tiles), each skipping
    # the other's sequences.
    # (constexpr test and runtime test kept as separate ifs: Triton resolves the outer at compile)
    if Q_FILTER == 1:
        if q_len > SHORT_Q:
            return
    elif Q_FILTER == 2:  # noqa: SIM102
        if q_len <= SHORT_Q:
            return
    num_q_tiles = tl.cdiv(q_len, BLOCK_Q)
    if tile_in_seq >= num_q_tiles:
        return
    # Latest q-tiles see the most keys: hand them out first so the causal tail does not straggle.
    q_tile = num_q_tiles - 1 - tile_in_seq
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # cached prefix length

    # ---- query rows: BLOCK_Q tokens x QUERIES_PER_KV heads, token-major ------------------------
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    tok_in_tile = offs_m // QUERIES_PER_KV
    tok_local = q_tile * BLOCK_Q + tok_in_tile  # [BLOCK_M] token index within the sequence
    row_valid = (tok_in_tile < BLOCK_Q) & (tok_local < q_len)
    q_pos = ctx_len + tok_local  # [BLOCK_M] absolute positions
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV  # [BLOCK_M] query head
    tok = (q_start + tok_local).to(tl.int64)  # [BLOCK_M] flat token index
    row_mask = row_valid[:, None] & d_mask[None, :]
    q_ptrs = query_ptr + tok[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if key_cache_ptr.dtype.element_ty.is_fp8() and q.dtype == tl.bfloat16:
        q = fp16_query(q)
    compute_dtype = q.dtype  # FP8 K/V tiles are cast to it
    if DOT_UPCAST:
        q = q.to(tl.float32)

    # ---- key range of this tile (and split) ----------------------------------------------------
    p_min = ctx_len + q_tile * BLOCK_Q  # first row's position
    p_max = ctx_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1  # last valid row's position
    kv_hi = p_max + 1
    if SLIDING:
        kv_lo = tl.maximum(p_min - sliding_window + 1, 0)
        full_lo = tl.maximum(p_max - sliding_window + 1, 0)  # keys >= this: in every row's window
    else:
        kv_lo = 0
        full_lo = 0
    range_lo = (kv_lo // BLOCK_N) * BLOCK_N
    # Split boundaries are multiples of BLOCK_N, so no tile straddles two splits.
    chunk = tl.cdiv(tl.cdiv(kv_hi - range_lo, num_splits), BLOCK_N) * BLOCK_N
    split_lo = range_lo + split_id * chunk
    split_hi = tl.minimum(split_lo + chunk, kv_hi)
    t_lo = split_lo // BLOCK_N
    t_hi = tl.cdiv(split_hi, BLOCK_N)
    # Tiles in [t_full_lo, t_full_hi) are visible to every row: no mask needed.
    t_full_lo = tl.minimum(tl.maximum(t_lo, (full_lo + BLOCK_N - 1) // BLOCK_N), t_hi)
    t_full_hi = tl.maximum(t_full_lo, tl.minimum(t_hi, (p_min + 1) // BLOCK_N))

    k_head_ptr = key_cache_ptr + kv_head.to(tl.int64) * stride_kc_h
    v_head_ptr = value_cache_ptr + kv_head.to(tl.int64) * stride_vc_h
    bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt_s
    offs_n = tl.arange(0, BLOCK_N)

    acc, l_i, m_i = _init_softmax_state(
        sinks_ptr, head, split_id, BLOCK_M, HEAD_DIM_V_PAD, SINKS, SPLIT
    )
    if ALIBI:
        slopes = tl.load(alibi_ptr + head) * 1.4426950408889634  # [BLOCK_M], log2 units
    else:
        slopes = 0.0
    if SLIDING:
        for t in range(t_lo, t_full_lo):  # window's lower edge
            acc, l_i, m_i = _attend_kv_tile(
                acc,
                l_i,
                m_i,
                q,
                q_pos,
                k_head_ptr,
                v_head_ptr,
                bt_row_ptr,
                t * BLOCK_N,
                seq_len,
                stride_kc_b,
                stride_kc_s,
                stride_vc_b,
                stride_vc_s,
                scale,
                softcap,
                sliding_window,
                offs_n,
                offs_d,
                offs_dv,
                True,
                SLIDING,
                SOFTCAP,
                PAGE_SIZE,
                HEAD_DIM,
                HEAD_DIM_PAD,
                HEAD_DIM_V,
                HEAD_DIM_V_PAD,
                DOT_PRECISION,
                DOT_UPCAST,
                compute_dtype,
                slopes,
                ALIBI,
            )
    for t in range(t_full_lo, t_full_hi):  # interior
        acc, l_i, m_i = _attend_kv_tile(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            k_head_ptr,
            v_head_ptr,
            bt_row_ptr,
            t * BLOCK_N,
            seq_len,
            stride_kc_b,
            stride_kc_s,
            stride_vc_b,
            stride_vc_s,
            scale,
            softcap,
            sliding_window,
            offs_n,
            offs_d,
            offs_dv,
            False,
            SLIDING,
            SOFTCAP,
            PAGE_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            HEAD_DIM_V,
            HEAD_DIM_V_PAD,
            DOT_PRECISION,
            DOT_UPCAST,
            compute_dtype,
            slopes,
            ALIBI,
        )
    for t in range(t_full_hi, t_hi):  # causal diagonal (and the partial last tile)
        acc, l_i, m_i = _attend_kv_tile(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            k_head_ptr,
            v_head_ptr,
            bt_row_ptr,
            t * BLOCK_N,
            seq_len,
            stride_kc_b,
            stride_kc_s,
            stride_vc_b,
            stride_vc_s,
            scale,
            softcap,
            sliding_window,
            offs_n,
            offs_d,
            offs_dv,
            True,
            SLIDING,
            SOFTCAP,
            PAGE_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            HEAD_DIM_V,
            HEAD_DIM_V_PAD,
            DOT_PRECISION,
            DOT_UPCAST,
            compute_dtype,
            slopes,
            ALIBI,
        )

    # Rows with l == 0 are padding rows (never stored) or empty splits (weight 0 in the reduce).
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc * (out_scale / l_safe)[:, None]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 units
        wo_ptrs = (
            ws_o_ptr
            + tok[:, None] * stride_wo_t
            + head[:, None] * stride_wo_h
            + split_id * stride_wo_s
            + offs_dv[None, :]
        )
        tl.store(wo_ptrs, o, mask=row_valid[:, None])
        wl_ptrs = ws_lse_ptr + tok * stride_wl_t + head * stride_wl_h + split_id
        tl.store(wl_ptrs, lse, mask=row_valid)
    else:
        o_ptrs = out_ptr + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_dv[None, :]
        o_mask = row_valid[:, None] & dv_mask[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
