"""Paged attention over a flat batch that mixes prefill chunks and decodes.

One entry point, `paged_attention`, for any step's batch: sequence i owns the new tokens
query_start_loc[i]:query_start_loc[i+1], which are the last q_len tokens of its seq_len; each
attends causally to the new tokens and fully to its cached prefix (optionally within a sliding
window), reading K/V from the paged cache through its block_table row.

How the work is cut (see the kernel for details):
- A program owns one q-tile of one sequence for one KV head: BLOCK_Q query tokens x all
  QUERIES_PER_KV query heads of that KV head, packed as BLOCK_M = BLOCK_Q * G rows (token-major).
  Packing the GQA group means each K/V tile is read once for all heads that share it, and a
  decode token (BLOCK_Q = 1) still gives tl.dot the 16 rows it needs.
- Prefill-shaped tiles (BLOCK_M 128): programs map to (seq, q-tile) by a binary search over
  query_start_loc on the device (no host sync; the grid is sized from host ints:
  T // BLOCK_Q + num_seqs). Decode-shaped tiles (BLOCK_M 16): program = sequence. A batch whose
  queries all fit a decode tile is one decode launch; a mixed batch is a prefill launch that
  skips the short queries plus a decode launch that takes only them.
- The KV loop is split into masked edge tiles and unmasked interior tiles, so the causal / window
  masks cost nothing on the bulk of a long context.
- Flash-decoding: for few, long decodes the KV range is also split across programs (grid axis 2),
  each writing a partial (output, log-sum-exp) to a float32 workspace; a reduce kernel combines.
- Tokens no sequence owns (past query_start_loc[-1], e.g. bucket padding) get zeros, so every
  output element is written.
All cache address arithmetic is int64: block_id * block stride passes 2^31 on large caches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hf_paged.worker.forward_context import AttentionMetadata

from .fused_gemv import gdc_launch_dependents, gdc_wait
from .kv_write import check_kv_cache_pair, check_launchable

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HEAD_DIMS_MAX = 256
_LOG2E = 1.4426950408889634


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Pure-torch reference (and the CPU backend). One sequence at a time, softmax in float32.

    Semantics (the contract every kernel must match): the new tokens of sequence i are the last
    q_len of its seq_len tokens; new token at absolute position p attends to keys k <= p, and with
    a sliding window W only to keys k > p - W (W tokens including itself, as transformers does).
    Softcapping applies cap * tanh(score / cap) to the scaled scores before masking.
    Tokens that no sequence owns (past query_start_loc[-1]) get zeros.
    """
    _, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    # zeros, not empty: rows no sequence owns (bucket padding) must not carry garbage/NaN onward
    out = torch.zeros_like(query)
    qsl = meta.query_start_loc_host or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_host or meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_table[i, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        q = query[start:end].float()
        # [Hkv, G, q_len, D] x [Hkv, D, seq_len] -> [Hkv, G, q_len, seq_len]
        q = q.reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(q, k.permute(1, 2, 0).unsqueeze(1)) * scale
        if softcap is not None and softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None and sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))  # [Hkv, G, q_len, D]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tanh through exp2: libdevice's tanh is not available under TRITON_INTERPRET. Saturates
    # cleanly to +-1 (exp2 -> inf or 0), absolute error ~1e-7 near 0.
    e = tl.exp2(x * 2.8853900817779268)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


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
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
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
    v_ptrs = v_head_ptr + v_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
    k = _load_kv_rows(k_ptrs, k_valid, offs_d, MASKED, HEAD_DIM, HEAD_DIM_PAD)
    if MASKED:
        keep = k_idx[None, :] <= q_pos[:, None]
        if SLIDING:
            keep = keep & (k_idx[None, :] > q_pos[:, None] - sliding_window)
    else:
        keep = k_valid  # not read: unmasked tiles skip the mask
    p, acc, l_i, m_new = _softmax_step(
        acc, l_i, m_i, q, k, keep, scale, softcap, MASKED, SOFTCAP, DOT_PRECISION, DOT_UPCAST
    )
    v = _load_kv_rows(v_ptrs, k_valid, offs_d, MASKED, HEAD_DIM, HEAD_DIM_PAD)
    return _accumulate_pv(acc, p, v, DOT_PRECISION, DOT_UPCAST), l_i, m_new


@triton.jit
def _softmax_step(
    acc,  # f32 [BLOCK_M, HEAD_DIM_PAD], unnormalised output
    l_i,  # f32 [BLOCK_M], running softmax denominator
    m_i,  # f32 [BLOCK_M], running max (log2 units)
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    k,  # [BLOCK_N, HEAD_DIM_PAD]
    keep,  # bool, broadcastable to [BLOCK_M, BLOCK_N]: the keys each row sees (MASKED)
    scale,
    softcap,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """Scores of one K tile and the online-softmax update: (P, acc rescaled, l, m)."""
    if DOT_UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # f32 [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        s = softcap * _tanh(s * (scale / softcap))
        s = s * 1.4426950408889634
    else:
        s = s * (scale * 1.4426950408889634)
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # A row can have seen no visible key yet (window edge): keep exp2 away from -inf - -inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, acc * alpha[:, None], l_i, m_new


@triton.jit
def _accumulate_pv(acc, p, v, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    p = p.to(v.dtype)  # the tensor cores take P in the cache dtype (bf16/fp16)
    if DOT_UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    return tl.dot(p, v, acc, input_precision=DOT_PRECISION)


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
@triton.jit(
    do_not_specialize=[
        "num_seqs",
        "num_tokens",
        "num_tile_programs",
        "num_splits",
        "stride_wo_t",
        "stride_wo_h",
        "stride_wl_t",
        "stride_wl_h",
    ]
)
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]
    ws_o_ptr,  # f32 [T, Hq, num_splits, HEAD_DIM_PAD] split partial outputs (SPLIT only)
    ws_lse_ptr,  # f32 [T, Hq, num_splits] split log2-sum-exp (SPLIT only)
    query_ptr,  # [T, Hq, D]
    key_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    value_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    block_table_ptr,  # int32 [num_seqs, max_blocks]
    seq_lens_ptr,  # int32 [num_seqs]
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    num_seqs,
    num_tokens,
    num_tile_programs,  # programs [0, num_tile_programs) compute, the rest zero-fill
    num_splits,
    scale,
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
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (see kernels/fused_gemv.py)
):
    if PDL:
        gdc_launch_dependents()  # the next kernel may be scheduled (and prefetch its weights)
        gdc_wait()  # q and the cache come from the previous kernel
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split_id = tl.program_id(2)
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    d_mask = offs_d < HEAD_DIM

    if pid >= num_tile_programs:
        # Zero-fill ZERO_TOKENS flat tokens that no sequence owns, for this kv head's q heads.
        first_unowned = tl.load(query_start_loc_ptr + num_seqs)
        offs_z = (pid - num_tile_programs) * ZERO_TOKENS + tl.arange(0, ZERO_TOKENS)
        # Only split 0 writes. (A scalar bool & a vector mask yields ints in the interpreter.)
        z_end = tl.where(split_id == 0, num_tokens, 0)
        z_mask = (offs_z >= first_unowned) & (offs_z < z_end)
        z_ptr = out_ptr + offs_z.to(tl.int64)[:, None] * stride_o_t + offs_d[None, :]
        zeros = tl.zeros([ZERO_TOKENS, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty)
        for h in tl.static_range(QUERIES_PER_KV):
            head = kv_head * QUERIES_PER_KV + h
            tl.store(z_ptr + head * stride_o_h, zeros, mask=z_mask[:, None] & d_mask[None, :])
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

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
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
                True,
                SLIDING,
                SOFTCAP,
                PAGE_SIZE,
                HEAD_DIM,
                HEAD_DIM_PAD,
                DOT_PRECISION,
                DOT_UPCAST,
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
            False,
            SLIDING,
            SOFTCAP,
            PAGE_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            DOT_PRECISION,
            DOT_UPCAST,
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
            True,
            SLIDING,
            SOFTCAP,
            PAGE_SIZE,
            HEAD_DIM,
            HEAD_DIM_PAD,
            DOT_PRECISION,
            DOT_UPCAST,
        )

    # Rows with l == 0 are padding rows (never stored) or empty splits (weight 0 in the reduce).
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 units
        wo_ptrs = (
            ws_o_ptr
            + tok[:, None] * stride_wo_t
            + head[:, None] * stride_wo_h
            + split_id * stride_wo_s
            + offs_d[None, :]
        )
        tl.store(wo_ptrs, o, mask=row_valid[:, None])
        wl_ptrs = ws_lse_ptr + tok * stride_wl_t + head * stride_wl_h + split_id
        tl.store(wl_ptrs, lse, mask=row_valid)
    else:
        o_ptrs = out_ptr + tok[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(
    do_not_specialize=["num_seqs", "num_splits", "stride_wo_t", "stride_wo_h", "stride_wl_t"]
)
def _reduce_splits_kernel(
    out_ptr,  # [T, Hq, D]
    ws_o_ptr,  # f32 [T, Hq, num_splits, HEAD_DIM_PAD]
    ws_lse_ptr,  # f32 [T, Hq, num_splits]
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    num_seqs,
    num_splits,
    stride_o_t,
    stride_o_h,
    stride_wo_t,
    stride_wo_h,
    stride_wo_s,
    stride_wl_t,
    stride_wl_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program = one (token, query head): combine the splits' partial softmaxes.
    if PDL:
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # query_start_loc is a step input (the host's copy, before the step's first, ordinary
    # launch), not the attention kernel's output: read before the wait, it is not a second
    # round trip in front of the partials on every layer's critical path
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return  # unowned token: the attention kernel already wrote zeros
    if PDL:
        gdc_wait()  # the partials come from the attention kernel
    offs_s = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    s_mask = offs_s < num_splits
    lse = tl.load(
        ws_lse_ptr + tok * stride_wl_t + head * stride_wl_h + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [SPLITS_PAD]; empty splits (lse = -inf) weigh 0
    o_ptrs = (
        ws_o_ptr
        + tok * stride_wo_t
        + head * stride_wo_h
        + offs_s[:, None] * stride_wo_s
        + offs_d[None, :]
    )
    o = tl.load(o_ptrs, mask=s_mask[:, None], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + tok * stride_o_t + head * stride_o_h + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tile shape and launch parameters. BLOCK_M = block_q * G rounded up to a power of 2."""

    block_m: int
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int
    one_tile_per_seq: bool  # decode-ish: every sequence's new tokens fit one q-tile


# Flash-decoding split heuristic, from H200 sweeps (evals/profiling/kernel_bench.py --sweep;
# Llama-3-8B heads, bf16, CUDA-graph timing): splitting pays while the grid is short of ~8
# (seq, kv head, split) programs per SM and each split streams >= ~512 keys (1 seq x 32k:
# 0.746 -> 0.056 ms with 32 splits; 16 x 8k: 0.225 -> 0.150 ms with 9). At 64 seqs it is
# neutral to slightly worse (64 x 2k: 0.146 ms unsplit, 0.155 with 3): a cut-off at ~2 programs
# per SM would be a little better there.
_SPLIT_TARGET_PROGRAMS_PER_SM = 8
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 32
_ZERO_TOKENS = 64


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: any small number; tests force the split count explicitly
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_config(queries_per_kv: int, head_dim: int) -> AttentionConfig:
    """One token x the whole GQA group per program; tl.dot needs >= 16 rows."""
    block_m = max(16, triton.next_power_of_2(queries_per_kv))
    # BLOCK_N 128: 98% of copy bandwidth at 64 x 8k on the H200, against 72-78% with 64 (sweep).
    block_n = 128 if head_dim <= 128 else 32
    return AttentionConfig(
        block_m,
        block_m // queries_per_kv,
        block_n,
        num_warps=4,
        num_stages=3,
        one_tile_per_seq=True,
    )


def prefill_config(queries_per_kv: int, head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """BLOCK_Q query tokens x the GQA group per program (FlashAttention-2-style tiles)."""
    if dtype == torch.float32:  # fp32 tiles are twice the bytes: halve them (not a fast path)
        block_m, block_n, warps, stages = 64, 32, 4, 2
    elif head_dim <= 128:
        # 128 x 128, 2 stages: 321 TFLOP/s at 8k on the H200, against 281 for 128 x 64 x 3.
        block_m, block_n, warps, stages = 128, 128, 8, 2
    else:  # head_dim 256: keep the accumulator and K/V stages within registers / shared memory
        block_m, block_n, warps, stages = 64, 32, 4, 2
    block_m = max(block_m, triton.next_power_of_2(queries_per_kv))
    return AttentionConfig(
        block_m, block_m // queries_per_kv, block_n, warps, stages, one_tile_per_seq=False
    )


def select_config(
    max_query_len: int, queries_per_kv: int, head_dim: int, dtype: torch.dtype = torch.bfloat16
) -> AttentionConfig:
    """Tile shape for a batch from host ints only (no GPU sync)."""
    dec = decode_config(queries_per_kv, head_dim)
    if max_query_len <= dec.block_q:
        return dec
    return prefill_config(queries_per_kv, head_dim, dtype)


def choose_num_kv_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    device: torch.device,
    min_keys_per_split: int = _MIN_KEYS_PER_SPLIT,
) -> int:
    """Flash-decoding split count: enough programs to fill the GPU, enough keys per split
    (decode_attention asks for fewer keys per split: one tile)."""
    programs = max(1, num_seqs * num_kv_heads)
    target = _SPLIT_TARGET_PROGRAMS_PER_SM * _num_sms(device)
    if programs >= target:
        return 1
    by_len = max(1, max_seq_len // min_keys_per_split)
    return max(1, min(triton.cdiv(target, programs), by_len, _MAX_SPLITS))


def choose_decode_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device
) -> int:
    """decode_attention's split count: one key tile per split (at most 32 splits), since it reads
    each split's first tile before the PDL wait and the rest after it. H200, 1.1B shape, batch
    1, the whole step in one CUDA graph, 2026-11-29: 16 splits for
    max_model_len 2048, against choose_num_kv_splits' 4 (>= 512 keys each), save 2 us a layer
    at 640 keys and 5 at 1536, and nothing at 256; 32 cost ~0.7 us more than 16. But not where
    that grid would take more than half the SMs: Llama-3-8B (8 KV heads x 16 = 128 programs)
    fell from 222 to 202 tok/s (same machine and date), presumably
    because the o-projection's programs then find no room to load their weights during
    attention (not measured); there choose_num_kv_splits' count stays."""
    splits = choose_num_kv_splits(
        num_seqs, num_kv_heads, max_seq_len, device, min_keys_per_split=block_n
    )
    if num_seqs * num_kv_heads * splits > _num_sms(device) // 2:
        splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_seq_len, device)
    return splits


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------


def _check_attention_args(query, key_cache, value_cache, meta, out) -> None:
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}"
        )
    check_kv_cache_pair(key_cache, value_cache)
    _, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_head_dim = key_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"key_cache head_dim {kv_head_dim} != query head_dim {head_dim}")
    if head_dim > _HEAD_DIMS_MAX or head_dim < 16:
        raise ValueError(f"query head_dim must be in [16, {_HEAD_DIMS_MAX}], got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of key_cache kv heads ({num_kv_heads})"
        )
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"key_cache block_size must be a power of 2, got {block_size}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query dtype must be float32/float16/bfloat16, got {query.dtype}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype != query.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != query dtype {query.dtype}")
    tensors = [("query", query), ("key_cache", key_cache), ("value_cache", value_cache)]
    if out is not None:
        if out.shape != query.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
        if out.dtype != query.dtype:
            raise ValueError(f"out dtype {out.dtype} != query dtype {query.dtype}")
        tensors.append(("out", out))
    for name, t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in head_dim (stride(-1) == 1), got strides {t.stride()}"
            )
    num_seqs = meta.seq_lens.shape[0] if meta.seq_lens.dim() == 1 else -1
    int_specs = (
        ("meta.query_start_loc", meta.query_start_loc, (num_seqs + 1,)),
        ("meta.seq_lens", meta.seq_lens, (num_seqs,)),
    )
    for name, t, shape in int_specs:
        if t.dim() != 1 or tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} (num_seqs={num_seqs}), got {tuple(t.shape)}"
            )
    bt = meta.block_table
    if bt.dim() != 2 or bt.shape[0] != num_seqs:
        raise ValueError(
            f"meta.block_table must be [num_seqs={num_seqs}, max_blocks], got {tuple(bt.shape)}"
        )
    if bt.shape[1] > 0 and bt.stride(1) != 1:
        raise ValueError(f"meta.block_table must be contiguous along blocks, strides {bt.stride()}")
    for name, t in (
        ("meta.query_start_loc", meta.query_start_loc),
        ("meta.seq_lens", meta.seq_lens),
        ("meta.block_table", bt),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if not t.is_contiguous() and t.dim() == 1:
            raise ValueError(f"{name} must be contiguous")
        tensors.append((name, t))
    for name, t in tensors:
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    check_launchable(query, "query")


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D], written in full
    *,
    num_kv_splits: int | None = None,
    config: AttentionConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:  # [T, Hq, D]
    """Triton paged attention; same semantics as `paged_attention_ref`.

    meta.max_query_len must be >= every sequence's query length (it selects the decode path,
    which gives each sequence a single q-tile) and meta.max_seq_len >= every seq_len (it sizes
    the flash-decoding split). Batches whose every query fits a decode tile run as one launch
    (plus the split reduce); other batches run prefill-shaped tiles for the long queries and,
    unless meta.min_query_len shows there are none, a decode-shaped launch for the short
    ones (a decode token in a 128-row prefill tile would waste 32x the tensor-core work).
    num_kv_splits overrides the flash-decoding split of decode-only batches (a CUDA graph should
    fix it at capture: it sets the grid); config forces one launch with that tile shape.
    pdl (Hopper, compiled kernels only): launch with programmatic dependent launch, so the
    kernel after this one may be scheduled (and prefetch its weights) while attention runs.
    """
    _check_attention_args(query, key_cache, value_cache, meta, out)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if config is not None:
        if config.block_q < 1 or config.block_m < config.block_q * group:
            raise ValueError(f"config {config} cannot hold {group} query heads per kv head")
        _launch(
            query,
            key_cache,
            value_cache,
            meta,
            scale,
            sliding_window,
            softcap,
            out,
            config,
            num_kv_splits or 1,
            q_filter=0,
            short_q=0,
            zero_fill=True,
            pdl=pdl,
        )
        return out

    dec = decode_config(group, head_dim)
    if meta.max_query_len <= dec.block_q:  # decode-only (or short speculative verifies)
        splits = num_kv_splits or choose_num_kv_splits(
            meta.seq_lens.shape[0], num_kv_heads, meta.max_seq_len, query.device
        )
        _launch(
            query,
            key_cache,
            value_cache,
            meta,
            scale,
            sliding_window,
            softcap,
            out,
            dec,
            splits,
            q_filter=0,
            short_q=0,
            zero_fill=True,
            pdl=pdl,
        )
        return out

    pre = prefill_config(group, head_dim, query.dtype)
    # once per step on the host (AttentionMetadata.min_query_len), not once per layer here
    has_short = meta.min_query_len is None or meta.min_query_len <= dec.block_q
    _launch(
        query,
        key_cache,
        value_cache,
        meta,
        scale,
        sliding_window,
        softcap,
        out,
        pre,
        1,
        q_filter=2 if has_short else 0,
        short_q=dec.block_q,
        zero_fill=True,
        pdl=pdl,
    )
    if has_short:
        # no split here: the reduce runs per token and would clobber the prefill rows
        _launch(
            query,
            key_cache,
            value_cache,
            meta,
            scale,
            sliding_window,
            softcap,
            out,
            dec,
            1,
            q_filter=1,
            short_q=dec.block_q,
            zero_fill=False,
            pdl=pdl,
        )
    return out


def _launch(
    query,
    key_cache,
    value_cache,
    meta,
    scale,
    sliding_window,
    softcap,
    out,
    cfg: AttentionConfig,
    num_splits: int,
    q_filter: int,
    short_q: int,
    zero_fill: bool,
    pdl: bool = False,
) -> None:
    num_tokens, _, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    num_seqs = meta.seq_lens.shape[0]
    if not cfg.one_tile_per_seq:
        num_splits = 1  # the reduce assumes one tile per sequence
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if cfg.one_tile_per_seq:
        num_tile_programs = num_seqs
    else:
        num_tile_programs = num_tokens // cfg.block_q + num_seqs
    num_zero_programs = triton.cdiv(num_tokens, _ZERO_TOKENS) if zero_fill else 0
    grid = (num_tile_programs + num_zero_programs, num_kv_heads, num_splits)
    if grid[0] == 0:
        return
    split = num_splits > 1
    ws_o, ws_lse = _split_workspace(query, out, num_splits, head_dim_pad)
    args, kwargs = _shared_launch_args(
        query, key_cache, value_cache, meta, out, ws_o, ws_lse, num_splits, head_dim_pad, scale,
        sliding_window, softcap, cfg, pdl,
    )  # fmt: skip
    _paged_attention_kernel[grid](
        out,
        ws_o,
        ws_lse,
        query,
        key_cache,
        value_cache,
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        num_seqs,
        num_tokens,
        num_tile_programs,
        num_splits,
        *args,
        BLOCK_Q=cfg.block_q,
        ZERO_TOKENS=_ZERO_TOKENS,
        ONE_TILE_PER_SEQ=cfg.one_tile_per_seq,
        Q_FILTER=q_filter,
        SHORT_Q=short_q,
        **kwargs,
    )
    if split:
        _reduce_splits(out, ws_o, ws_lse, meta, num_splits, head_dim, head_dim_pad, pdl)


def _shared_launch_args(
    query, key_cache, value_cache, meta, out, ws_o, ws_lse, num_splits, head_dim_pad, scale,
    sliding_window, softcap, cfg: AttentionConfig, pdl: bool,
):  # fmt: skip
    """What both attention kernels (this one, decode_attention's) take alike: the positional run
    from scale to the workspace strides, then the shared constexprs and launch options."""
    head_dim = query.shape[2]
    sliding = sliding_window is not None and sliding_window > 0
    capped = softcap is not None and softcap > 0
    split = num_splits > 1
    # Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits: upcast there
    # (after the same bf16 rounding of P), so CPU CI checks the arithmetic the GPU does.
    upcast = query.dtype == torch.bfloat16 and query.device.type == "cpu"
    args = (
        float(scale),
        float(softcap) if capped else 1.0,
        int(sliding_window) if sliding else 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        meta.block_table.stride(0),
        ws_o.stride(0),
        ws_o.stride(1),
        ws_o.stride(2) if split else 0,
        ws_lse.stride(0),
        ws_lse.stride(1),
    )
    kwargs = dict(
        QUERIES_PER_KV=query.shape[1] // key_cache.shape[2],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=key_cache.shape[1],
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SPLIT=split,
        SLIDING=sliding,
        SOFTCAP=capped,
        # float32 inputs: true fp32 products (tf32 would cost ~1e-3 relative error).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if pdl:
        kwargs["launch_pdl"] = True
    return args, kwargs


def _split_workspace(query, out, num_splits: int, head_dim_pad: int):
    """The flash-decoding partials, one allocation: f32 outputs [T, Hq, S, D_pad] and log2-sum-
    exps [T, Hq, S]; unsplit, (out, out) (SPLIT is constexpr False: any pointer will do)."""
    if num_splits == 1:
        return out, out
    num_tokens, num_q_heads = query.shape[:2]
    n_o = num_tokens * num_q_heads * num_splits * head_dim_pad
    ws = torch.empty(
        n_o + num_tokens * num_q_heads * num_splits, dtype=torch.float32, device=query.device
    )
    ws_o = ws[:n_o].view(num_tokens, num_q_heads, num_splits, head_dim_pad)
    return ws_o, ws[n_o:].view(num_tokens, num_q_heads, num_splits)


def _reduce_splits(out, ws_o, ws_lse, meta, num_splits, head_dim, head_dim_pad, pdl) -> None:
    """Combine the splits' partials into out, one program per (token, query head)."""
    _reduce_splits_kernel[(out.shape[0], out.shape[1])](
        out,
        ws_o,
        ws_lse,
        meta.query_start_loc,
        meta.seq_lens.shape[0],
        num_splits,
        out.stride(0),
        out.stride(1),
        ws_o.stride(0),
        ws_o.stride(1),
        ws_o.stride(2),
        ws_lse.stride(0),
        ws_lse.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
