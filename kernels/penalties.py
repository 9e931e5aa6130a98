"""Repetition, presence and frequency penalties on logits rows in one pass.

Why: in torch the penalties were a chain of [rows, vocab] passes (gather the count rows and the
prompt masks from the pool, compare, two selects, multiply/divide, subtract, scatter the rows
back), each reading and writing the whole batch; at 128 rows of a 152k vocabulary each pass
moves ~78 MB. Here each entry is read once (logit, count, prompt flag) and written once.

The arithmetic is hf_paged.sample.logits_processing's (transformers' repetition penalty on
every token of the prompt and the output: score < 0 ? score * p : score / p; then vLLM's
presence and frequency penalties on output tokens: score - freq * count - pres * (count > 0)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2

_BLOCK = 4096


@triton.jit
def _penalties_kernel(
    x_ptr,
    x_stride,
    out_ptr,
    out_stride,
    rows_ptr,  # int64 [R]: the row of x (and out) each program row works on
    slots_ptr,  # int64 [R]: its row in the pool
    counts_ptr,  # int32 [slots, V]
    prompt_ptr,  # uint8 [slots, V]
    pool_stride,
    rep_ptr,
    pres_ptr,
    freq_ptr,
    V,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    row = tl.load(rows_ptr + r)
    slot = tl.load(slots_ptr + r)
    x = tl.load(x_ptr + row * x_stride + offs, mask=inside, other=0.0).to(tl.float32)
    count = tl.load(counts_ptr + slot * pool_stride + offs, mask=inside, other=0)
    in_prompt = tl.load(prompt_ptr + slot * pool_stride + offs, mask=inside, other=0)
    rep = tl.load(rep_ptr + r)
    pres = tl.load(pres_ptr + r)
    freq = tl.load(freq_ptr + r)
    seen = (in_prompt != 0) | (count > 0)
    x = tl.where(seen, tl.where(x < 0, x * rep, x / rep), x)
    x = x - freq * count.to(tl.float32)
    x = x - pres * (count > 0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, x, mask=inside)


def apply_penalties(
    scores: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """scores [B, V] (any float dtype) -> float32 [B, V] with the penalties on `rows` (int64
    [R], distinct) from pool rows `slots` (int64 [R]) of output_counts (int32 [S, V]) and
    prompt_mask (bool [S, V]); repetition/presence/frequency: float [R]. Other rows are copied."""
    num, vocab = scores.shape
    if output_counts.shape[1] != vocab or prompt_mask.shape != output_counts.shape:
        raise ValueError("apply_penalties: the pool's width must be the logits' vocabulary")
    n = rows.shape[0]
    for name, t in (("slots", slots), ("repetition", repetition), ("presence", presence)):
        if t.shape != (n,):
            raise ValueError(f"apply_penalties: {name} must be [{n}]")
    if frequency.shape != (n,):
        raise ValueError(f"apply_penalties: frequency must be [{n}]")
    if n == num:  # every row is written
        out = torch.empty(num, vocab, dtype=torch.float32, device=scores.device)
    else:
        out = scores.float().clone() if scores.dtype == torch.float32 else scores.float()
    if n == 0:
        return out
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    counts = output_counts.contiguous()
    prompt = prompt_mask.contiguous().view(torch.uint8)
    block = min(_BLOCK, next_power_of_2(vocab))
    _penalties_kernel[(n, cdiv(vocab, block))](
        scores,
        scores.stride(0),
        out,
        out.stride(0),
        rows.long().contiguous(),
        slots.long().contiguous(),
        counts,
        prompt,
        counts.stride(0),
        repetition.float().contiguous(),
        presence.float().contiguous(),
        frequency.float().contiguous(),
        vocab,
        BLOCK=block,
        num_warps=8,
    )
    return out
