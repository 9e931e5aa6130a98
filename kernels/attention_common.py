"""The online-softmax arithmetic of one key tile, shared by both paged-attention kernels.

paged_attention_kernel.py's general kernel and decode_attention.py's early-read decode kernel
both attend a tile of keys with these helpers, so the two compute the same scores, the same
exp2 online-softmax update and the same P.V in the same order (the decode tests compare them at
a quarter of the tolerance they allow against the reference):
- _softmax_step: the scores of one K tile, softcapped (_tanh), biased (ALiBi) and masked, and
  the update of the running max, denominator and rescaled accumulator;
- _accumulate_pv: P.V into the accumulator, with P in the cache dtype the tensor cores take;
- _init_softmax_state: the empty running state, or with attention sinks the state after one
  virtual key whose logit is the head's sink and whose value is zeros.
Callers import each helper by name at module level: Triton resolves a @triton.jit callee through
the calling function's module globals.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh through exp2: libdevice's tanh is not available under TRITON_INTERPRET. Saturates
    # cleanly to +-1 (exp2 -> inf or 0), absolute error ~1e-7 near 0.
    e = tl.exp2(x * 2.8853900817779268)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


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
    bias=0.0,  # f32 [BLOCK_M, BLOCK_N], log2 units, added to the scaled scores (BIAS only)
    BIAS: tl.constexpr = False,
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
    if BIAS:  # ALiBi: slope * (key position - query position), after the scale and any cap
        s = s + bias
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
def _init_softmax_state(
    sinks_ptr,  # f32 [Hq] (SINKS only)
    head,  # int [BLOCK_M]: each row's query head
    split_id,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """(acc, l, m) before the first key tile. A sink adds exp(sink) to the softmax denominator
    and nothing to the output: the state after a key of logit `sink` (log2 units: m = sink *
    log2(e), l = 1) and value zeros. With flash-decoding splits only split 0 holds it: the
    reduce weighs each split by its sum of exps, so the sink is counted once."""
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # [BLOCK_M], log2 units
        if SPLIT:
            m_i = tl.where(split_id == 0, sink, float("-inf"))
            l_i = tl.where(split_id == 0, 1.0, 0.0) + tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            m_i = sink
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    return acc, l_i, m_i


@triton.jit
def fp16_query(q):
    # An FP8 cache under bf16 queries: the scores and P.V run in fp16, not bf16. H200, Llama-3-8B
    # heads, 2026-12-03 (evals/profiling/fp8_attention_bench.py --sweep): casting FP8 tiles to
    # bf16 costs more than the halved bytes save (decode 256 x 4k 1.19 ms against 1.04 on a bf16
    # cache; prefill 2 x 4k 1.11 against 0.97), while float8 -> fp16 is one conversion an
    # element pair: 0.83 and 0.96 ms. Both FP8 formats are exact in fp16, as is every bf16 query
    # element of magnitude in [2^-14, 65504]; smaller ones keep fewer bits (they move a score
    # by < 2^-24 of a key), larger ones saturate at 65504 instead of overflowing. P is rounded
    # to fp16: finer than bf16 for P in [2^-14, 1], coarser below, where a term weighs less
    # than 2^-14 of the row's largest.
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
