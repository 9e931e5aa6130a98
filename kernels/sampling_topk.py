"""Categorical sampling of top-k rows (small k) from their k largest logits, without a search.

Why: kernels/sampling.py finds the top-k and top-p cuts by threshold searches, a dozen passes of
pivot counting over the row by one program, which is latency-bound: 3.7 ms for 128 rows of a
152k vocabulary on the H200, against 0.44 ms for multinomial on the softmax. When every row of a
group has 0 < k <= TOPK_CAP, torch.topk (a multi-block radix select) gives each row's KP >= k
largest logits, and everything the cuts need is in that short sorted list:

- the k-th largest z = x / T is the list's k-th entry (z is monotone in x);
- every survivor with z above it is in the list, and so is every survivor equal to it unless
  the list ends inside that tie; then one pass over the row counts them (`tail`);
- top-p over the survivors: a value v stays when the survivors strictly above it hold less than
  p of their mass; in the descending list that is the exclusive running mass at v's first entry,
  so the cut is the smallest list value whose running mass is below p * mass, or the k-th value
  itself when the whole list above it holds less than that;
- min-p: e = exp(z - max z) >= min_p, a comparison.

So the kept set is {z >= t, e >= min_p} with its mass known, and a pass over the row draws by
inverse CDF in index order with the row's uniform u: the first kept index whose running mass
exceeds u * (kept mass), exactly the rule of kernels/sampling.py and its torch reference
(sample_rows_ref), with the same tie rule (a value tied at a cut is kept whole). The draw stops
at the drawn token: on average about half a read of the row, plus a whole read when the list
ends inside the k-th value's tie.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import next_power_of_2
from .sampling import _draw, _row_z

TOPK_CAP = 1024  # rows with a larger k take kernels/sampling.py
_MIN_KP = 64  # list lengths are powers of two from here: few kernel variants to compile
_BLOCK = 4096


def list_length(k_max: int) -> int:
    """The candidate list length for a group whose largest top_k is k_max (<= TOPK_CAP)."""
    return max(_MIN_KP, next_power_of_2(k_max))


@triton.jit
def _topk_rows_kernel(
    x_ptr,
    stride,
    V,
    cand_ptr,
    cand_stride,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    u_ptr,
    out_ptr,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = x_ptr + row.to(tl.int64) * stride
    T = tl.load(temp_ptr + row)
    k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), KP)
    p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    u = tl.load(u_ptr + row)
    # the list: the row's KP largest logits, descending
    i = tl.arange(0, KP)
    zc = tl.load(cand_ptr + row.to(tl.int64) * cand_stride + i).to(tl.float32) / T
    zc = tl.where(zc == 0.0, 0.0, zc)
    m = tl.max(zc)
    t = tl.sum(tl.where(i == k - 1, zc, 0.0))  # the k-th largest z
    # how many entries of the row equal t: all in the list when the list ends below t,
    # else (the list ends inside the tie) pass 1 counts them over the row
    tail = tl.sum((zc == t).to(tl.float32))
    if tl.sum(tl.where(i == KP - 1, zc, 0.0)) == t:
        tail = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            z = _row_z(row_ptr, offs, V, T)
            tail += tl.sum(((z == t) & (offs < V)).to(tl.float32))
    e = tl.exp(zc - m)
    e_t = tl.exp(t - m)
    above = (i < k) & (zc > t)  # survivors above t: all in the list
    w = tl.where(above, e, 0.0)
    w_above = tl.sum(w)
    survivors = w_above + tail * e_t
    cut = t
    if p < 1.0:
        if w_above >= p * survivors:  # t itself falls outside the top-p mass
            excl = tl.cumsum(w, 0) - w  # mass of the list entries before each one
            cut = tl.min(tl.where(above & (excl < p * survivors), zc, float("inf")))
    keep_t = (cut == t) & (e_t >= min_p)
    kept_mass = tl.sum(tl.where(above & (zc >= cut) & (e >= min_p), e, 0.0))
    kept_mass += tl.where(keep_t, tail * e_t, 0.0)
    # pass 2: inverse CDF in index order, kernels/sampling.py's draw
    token = _draw(row_ptr, V, T, m, cut, min_p, u * kept_mass, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_rows_topk(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
    k_max: int,
) -> torch.Tensor:
    """kernels.sampling.sample_rows for rows whose top_k are all in [1, k_max] (the caller knows
    its rows' values: k_max is their maximum, k_max <= TOPK_CAP and list_length(k_max) <= vocab).
    Same arguments and result otherwise."""
    from hf_paged.kernels.sampling import _check  # one set of argument checks for both kernels

    _check(x, temperature, top_k, top_p, min_p, u)
    rows, vocab = x.shape
    kp = list_length(k_max)
    if not 1 <= k_max <= TOPK_CAP or kp > vocab:
        raise ValueError(
            f"sample_rows_topk: k_max must be in [1, {TOPK_CAP}] with a list of {kp} <= the "
            f"vocabulary ({vocab}), got {k_max}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    cand = x.topk(kp, dim=-1, sorted=True).values
    _topk_rows_kernel[(rows,)](
        x,
        x.stride(0),
        vocab,
        cand,
        cand.stride(0),
        temperature.float().contiguous(),
        top_k.to(torch.int32).contiguous(),
        top_p.float().contiguous(),
        min_p.float().contiguous(),
        u.float().contiguous(),
        out,
        KP=kp,
        BLOCK=min(_BLOCK, next_power_of_2(vocab)),
        num_warps=8,
    )
    return out
