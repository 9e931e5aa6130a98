"""Flash-decoding: the split-KV workspace and the kernel that combines the splits.

With num_splits > 1 an attention kernel (paged_attention's or decode_attention's) splits each
sequence's key range across programs, each writing a partial output normalised by its own
softmax denominator and that split's log2-sum-exp. This module holds what both kernels share
about those partials: their one float32 allocation (_split_workspace) and the reduce that
weighs each split by its sum of exps to produce the output (_reduce_splits and its kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_gemv import gdc_launch_dependents, gdc_wait
from .host_math import next_power_of_2


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
        SPLITS_PAD=next_power_of_2(num_splits),
        PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
