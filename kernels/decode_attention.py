"""Paged attention for decode steps (one new token per sequence) that reads the cache early.

The small-batch forward launches attention with programmatic dependent launch (PDL): it may
start while the kernel before it (norm_qkv_rope, which writes this step's K/V) still runs, and
waits (griddepcontrol.wait) before reading what that kernel wrote. At batch 1 attention is
latency, not bytes: ~7 us a layer on the H200 for a few hundred keys, a chain of dependent loads
(sequence length, block table, K, V) after that wait. Everything in that chain except the
query and the new token's K/V row was written by earlier steps, so this kernel issues it
before the wait: the block ids and the K/V rows of each program's first tile of keys are in
registers by the time the previous kernel finishes. After the wait it loads the query, re-reads
the one row of the tile the previous kernel wrote (the new token's position), and computes.

Same arithmetic as paged_attention's decode tiles (one token x the GQA group of a KV head per
program; the online-softmax step of kernels/attention_common.py, flash-decoding splits combined
by kernels/split_kv_reduce.py), for batches where every sequence has exactly one query token:
token i belongs to sequence i. Other batches use paged_attention.

Why the early reads are safe: a decode step writes only the new token's slot of each layer's
cache, and the step's first kernel (the embedding) is an ordinary launch, which starts only
after everything before it in the stream (earlier steps' writes, block copies, the host's
copies of seq_lens and block tables) has finished.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_paged.worker.forward_context import AttentionMetadata

from .attention_common import _accumulate_pv, _init_softmax_state, _softmax_step
from .attention_config import AttentionConfig, choose_decode_num_kv_splits, decode_config
from .fused_gemv import gdc_launch_dependents, gdc_wait
from .host_math import next_power_of_2
from .kv_write import check_kv_scales
from .paged_attention import _check_attention_args, _shared_launch_args, sinks_for_kernel
from .split_kv_reduce import _reduce_splits, _split_workspace


@triton.jit
def _attend(
    acc, l_i, m_i, q, k, v, keep, scale, softcap,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):  # fmt: skip
    # paged_attention's masked tile (_attend_kv_tile) on K/V already loaded; keep: [BLOCK_N]
    if k.dtype.is_fp8():  # an FP8 cache: scales applied by the caller, as in paged_attention
        k = k.to(COMPUTE_DTYPE)
        v = v.to(COMPUTE_DTYPE)
    p, acc, l_i, m_i = _softmax_step(
        acc, l_i, m_i, q, k, keep[None, :], scale, softcap, True, SOFTCAP, DOT_PRECISION,
        DOT_UPCAST,
    )  # fmt: skip
    return _accumulate_pv(acc, p, v, DOT_PRECISION, DOT_UPCAST), l_i, m_i


# the block table's row stride varies by step as in kernels/paged_attention_kernel.py
@triton.jit(
    do_not_specialize=["num_splits", "stride_bt_s", "stride_wo_t", "stride_wo_h", "stride_wl_t"]
)
def _decode_attention_kernel(
    out_ptr,  # [T, Hq, Dv]
    ws_o_ptr,  # f32 [T, Hq, num_splits, HEAD_DIM_V_PAD] (SPLIT only)
    ws_lse_ptr,  # f32 [T, Hq, num_splits] (SPLIT only)
    query_ptr,  # [T, Hq, D]; token i is sequence i's only query
    key_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    value_cache_ptr,
    block_table_ptr,  # int32 [T, max_blocks]
    seq_lens_ptr,  # int32 [T]
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
    HEAD_DIM_V: tl.constexpr,  # a value head's width (MLA: != HEAD_DIM)
    HEAD_DIM_V_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # the o-projection may be scheduled and fetch its weights
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split_id = tl.program_id(2)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    if HEAD_DIM_V == HEAD_DIM:  # the usual case: one set of offsets, the code as before
        offs_dv = offs_d
        dv_mask = d_mask
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
        dv_mask = offs_dv < HEAD_DIM_V
    offs_n = tl.arange(0, BLOCK_N)

    # ---- before the wait: only what earlier steps wrote --------------------------------------
    seq_len = tl.load(seq_lens_ptr + seq)
    pos = seq_len - 1  # the new token's position: its K/V row is written by the kernel before
    if SLIDING:
        kv_lo = tl.maximum(pos - sliding_window + 1, 0)
    else:
        kv_lo = 0
    range_lo = (kv_lo // BLOCK_N) * BLOCK_N
    # the split boundaries paged_attention uses: multiples of BLOCK_N
    chunk = tl.cdiv(tl.cdiv(seq_len - range_lo, num_splits), BLOCK_N) * BLOCK_N
    split_lo = range_lo + split_id * chunk
    split_hi = tl.minimum(split_lo + chunk, seq_len)
    t_lo = split_lo // BLOCK_N
    t_hi = tl.cdiv(split_hi, BLOCK_N)
    k_head_ptr = key_cache_ptr + kv_head.to(tl.int64) * stride_kc_h
    v_head_ptr = value_cache_ptr + kv_head.to(tl.int64) * stride_vc_h
    bt_row_ptr = block_table_ptr + seq * stride_bt_s

    k_idx = t_lo * BLOCK_N + offs_n  # the first tile's key positions
    k_ok = k_idx < split_hi
    block_ids = tl.load(bt_row_ptr + k_idx // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
    in_page = (k_idx % PAGE_SIZE).to(tl.int64)
    k_ptrs = k_head_ptr + (block_ids * stride_kc_b + in_page * stride_kc_s)[:, None]
    v_ptrs = v_head_ptr + (block_ids * stride_vc_b + in_page * stride_vc_s)[:, None]
    kv_mask = k_ok[:, None] & d_mask[None, :]
    v_mask = k_ok[:, None] & dv_mask[None, :]
    k = tl.load(k_ptrs + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs + offs_dv[None, :], mask=v_mask, other=0.0)
    # where the new token's K/V row lives: the block table is a step input, read before the wait
    pos_block = tl.load(bt_row_ptr + pos // PAGE_SIZE).to(tl.int64)
    pos_in_page = (pos % PAGE_SIZE).to(tl.int64)
    new_k_ptr = k_head_ptr + pos_block * stride_kc_b + pos_in_page * stride_kc_s + offs_d
    new_v_ptr = v_head_ptr + pos_block * stride_vc_b + pos_in_page * stride_vc_s + offs_dv

    if PDL:
        gdc_wait()  # the query and the new token's K/V come from the previous kernel
    offs_m = tl.arange(0, BLOCK_M)
    row_valid = offs_m < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m
    row_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(
        query_ptr + seq * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    if DOT_UPCAST:
        q = q.to(tl.float32)
    # the new token's row, if this tile holds it, as the previous kernel wrote it: one row read
    # and broadcast into the tile (a masked re-read of the whole tile doubled its registers:
    # compiled for sm_90 at the 1.1B shape, 4 warps, 255 registers and ~970 spill instructions)
    fresh = (k_idx == pos)[:, None]
    k = tl.where(fresh, tl.load(new_k_ptr, mask=d_mask, other=0.0)[None, :], k)
    v = tl.where(fresh, tl.load(new_v_ptr, mask=dv_mask, other=0.0)[None, :], v)

    # rows past the GQA group are padding (never stored): their sink is read from a real head
    sink_head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    acc, l_i, m_i = _init_softmax_state(
        sinks_ptr, sink_head, split_id, BLOCK_M, HEAD_DIM_V_PAD, SINKS, SPLIT
    )
    if t_lo < t_hi:
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, k, v, k_ok & (k_idx >= kv_lo), scale, softcap,
            SOFTCAP, DOT_PRECISION, DOT_UPCAST, out_ptr.dtype.element_ty,
        )  # fmt: skip
    for t in range(t_lo + 1, t_hi):  # the split's further tiles: loaded after the wait
        k_idx = t * BLOCK_N + offs_n
        k_ok = k_idx < split_hi
        block_ids = tl.load(bt_row_ptr + k_idx // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_page = (k_idx % PAGE_SIZE).to(tl.int64)
        kv_mask = k_ok[:, None] & d_mask[None, :]
        v_mask = k_ok[:, None] & dv_mask[None, :]
        k_off = (block_ids * stride_kc_b + in_page * stride_kc_s)[:, None] + offs_d[None, :]
        v_off = (block_ids * stride_vc_b + in_page * stride_vc_s)[:, None] + offs_dv[None, :]
        k = tl.load(k_head_ptr + k_off, mask=kv_mask, other=0.0)
        v = tl.load(v_head_ptr + v_off, mask=v_mask, other=0.0)
        acc, l_i, m_i = _attend(
            acc,
            l_i,
            m_i,
            q,
            k,
            v,
            k_ok,
            scale,
            softcap,
            SOFTCAP,
            DOT_PRECISION,
            DOT_UPCAST,
            out_ptr.dtype.element_ty,
        )

    # an empty split (l == 0) weighs 0 in the reduce
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc * (out_scale / l_safe)[:, None]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 units
        wo = ws_o_ptr + seq * stride_wo_t + head[:, None] * stride_wo_h + split_id * stride_wo_s
        tl.store(wo + offs_dv[None, :], o, mask=row_valid[:, None])
        tl.store(
            ws_lse_ptr + seq * stride_wl_t + head * stride_wl_h + split_id, lse, mask=row_valid
        )
    else:
        o_ptrs = out_ptr + seq * stride_o_t + head[:, None] * stride_o_h + offs_dv[None, :]
        o_mask = row_valid[:, None] & dv_mask[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


def decode_attention_config(queries_per_kv: int, head_dim: int) -> AttentionConfig:
    """decode_config's tile, with 8 warps and a key tile that holds the prefetched K/V in
    registers without spilling. Compiled for sm_90 (Triton 3.6, ptxas -v): with decode_config's
    4 warps x 128 keys this kernel spilled, 967 spill instructions at head_dim 64 (255
    registers) and 23 KB of spill stores at head_dim 128 (ptxas settled on 32 registers and a
    7.9 KB stack); 8 warps x 128 keys at head_dim 64 and 8 x 64 at 128 compile to 190 / 196
    registers and no spills. H200 (2026-11-30, one call): the 1.1B shape's batch 1 1,332-1,336
    tok/s with this tile against 1,317-1,321 with decode_config's."""
    dec = decode_config(queries_per_kv, head_dim)
    # at most 8192 entries a K (and V) tile, whose columns are head_dim padded to a power of 2:
    # 128 keys at head_dim 64, 64 at 80-128
    block_n = min(dec.block_n, 8192 // next_power_of_2(head_dim))
    return AttentionConfig(dec.block_m, dec.block_q, block_n, 8, dec.num_stages, True)


def decode_attention(
    query: torch.Tensor,  # [num_seqs, Hq, D]: one new token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    sinks: torch.Tensor | None = None,  # [Hq]: attention sinks, as in paged_attention
    num_kv_splits: int | None = None,
    pdl: bool = False,
    k_scale: float = 1.0,  # FP8 caches, as in paged_attention
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_seqs, Hq, Dv]
    """paged_attention for a batch whose every sequence has exactly one query token (token i
    is sequence i's, meta.max_query_len == 1), with the cache reads issued before the PDL wait.
    num_kv_splits and meta.max_seq_len set the flash-decoding split as in paged_attention."""
    _check_attention_args(query, key_cache, value_cache, meta, None)
    check_kv_scales(k_scale, v_scale)
    sinks = sinks_for_kernel(sinks, query)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = meta.seq_lens.shape[0]
    if meta.max_query_len != 1 or num_tokens != num_seqs:
        raise ValueError(
            f"decode_attention takes one query token per sequence: meta.max_query_len "
            f"{meta.max_query_len} (must be 1), {num_tokens} tokens for {num_seqs} sequences"
        )
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    num_kv_heads, head_dim_v = key_cache.shape[2], value_cache.shape[3]
    out = query.new_empty(num_tokens, num_q_heads, head_dim_v)
    if num_tokens == 0:
        return out
    cfg = decode_attention_config(num_q_heads // num_kv_heads, max(head_dim, head_dim_v))
    splits = num_kv_splits or choose_decode_num_kv_splits(
        num_seqs, num_kv_heads, meta.max_seq_len, cfg.block_n, query.device
    )
    head_dim_v_pad = max(16, next_power_of_2(head_dim_v))
    ws_o, ws_lse = _split_workspace(query, out, splits, head_dim_v_pad)
    args, kwargs = _shared_launch_args(
        query, key_cache, value_cache, meta, out, ws_o, ws_lse, splits,
        (float(scale) * k_scale, float(v_scale)), sliding_window, softcap, sinks, cfg, pdl,
    )  # fmt: skip
    _decode_attention_kernel[(num_seqs, num_kv_heads, splits)](
        out,
        ws_o,
        ws_lse,
        query,
        key_cache,
        value_cache,
        meta.block_table,
        meta.seq_lens,
        splits,
        *args,
        **kwargs,
    )
    if splits > 1:
        _reduce_splits(out, ws_o, ws_lse, meta, splits, head_dim_v, head_dim_v_pad, pdl)
    return out
