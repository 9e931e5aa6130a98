"""The embedding lookup that starts a small-batch step, with the step's token ids resolved inside.

With asynchronous scheduling a decode step's input token was sampled by the step before and is
on the device only (the runner's last_tokens, by InputBatch row). In a CUDA graph the step then
ran three torch kernels before its first layer: last_tokens[rows], a where() against the tokens
the host sent, and the embedding gather (~6.3 us of kernels and their gaps on the H200 at batch
1, evals/profiling/engine_bench.py --only batch1 --kernels). This kernel does all three: token
t is last_tokens[rows[t]] where pending[t], else input_ids[t], and out[t] = weight[token].

With pdl=True it lets the next kernel launch at once (griddepcontrol.launch_dependents), so the
first layer's norm_qkv_rope loads its weights while this runs; it is itself launched as usual,
after everything before it in the stream (the host's copies of input_ids, rows, pending).

A token id outside [0, vocab) gives a zero row (torch's embedding would fault the device); the
engine checks prompt ids when a request is added, and sampled ids are in range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_gemv import gdc_launch_dependents
from .host_math import cdiv, next_power_of_2
from .kv_write import check_launchable, interpreting

_MAX_BLOCK_H = 4096


@triton.jit
def _embed_tokens_kernel(
    w_ptr,
    ids_ptr,
    pending_ptr,
    rows_ptr,
    last_ptr,
    out_ptr,
    V,
    H,
    stride_w,
    stride_o,
    PENDING: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token = tl.load(ids_ptr + t)
    if PENDING:
        if tl.load(pending_ptr + t) != 0:
            token = tl.load(last_ptr + tl.load(rows_ptr + t))
    token = token.to(tl.int64)
    ok = (token >= 0) & (token < V)
    h_mask = offs < H
    row = tl.load(w_ptr + tl.where(ok, token, 0) * stride_w + offs, mask=h_mask, other=0.0)
    row = tl.where(ok, row, tl.zeros_like(row))
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, row, mask=h_mask)


def embed_tokens(
    weight: torch.Tensor,  # [vocab, hidden]
    input_ids: torch.Tensor,  # int64 [T]
    pending: torch.Tensor | None = None,  # bool [T]: take last_tokens[rows[t]] instead
    rows: torch.Tensor | None = None,  # int64 [T]
    last_tokens: torch.Tensor | None = None,  # int64 [max rows]
    *,
    pdl: bool = False,
) -> torch.Tensor:  # [T, hidden], weight's dtype
    """embed_tokens_ref(...) by one Triton launch."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [vocab, hidden] with contiguous rows, got {tuple(weight.shape)} "
            f"strides {weight.stride()}"
        )
    _check_ids("input_ids", input_ids, None)
    t = input_ids.shape[0]
    given = [x is not None for x in (pending, rows, last_tokens)]
    if any(given) and not all(given):
        raise ValueError("pending, rows and last_tokens go together: pass all three or none")
    if pending is not None:
        if pending.dtype != torch.bool or pending.shape != (t,) or pending.stride(0) != 1:
            got = f"{pending.dtype} {list(pending.shape)} strides {pending.stride()}"
            raise ValueError(f"pending must be bool [{t}], contiguous, got {got}")
        _check_ids("rows", rows, t)
        _check_ids("last_tokens", last_tokens, None)
    check_launchable(weight, "weight")
    vocab, hidden = weight.shape
    out = torch.empty((t, hidden), dtype=weight.dtype, device=weight.device)
    if t == 0 or hidden == 0:
        return out
    block_h = min(next_power_of_2(hidden), _MAX_BLOCK_H)
    p = pending is not None
    _embed_tokens_kernel[(t, cdiv(hidden, block_h))](
        weight,
        input_ids,
        pending if p else input_ids,
        rows if p else input_ids,
        last_tokens if p else input_ids,
        out,
        vocab,
        hidden,
        weight.stride(0),
        out.stride(0),
        PENDING=p,
        BLOCK_H=block_h,
        PDL=pdl and not interpreting(),
        num_warps=4,
    )
    return out


def embed_tokens_ref(weight, input_ids, pending=None, rows=None, last_tokens=None):
    """What the kernel computes, in torch (ids in range)."""
    if pending is not None:
        input_ids = torch.where(pending, last_tokens[rows], input_ids)
    return torch.nn.functional.embedding(input_ids, weight)


def _check_ids(name: str, ids: torch.Tensor, length: int | None) -> None:
    # the kernel reads entry t at ids_ptr + t
    bad_len = length is not None and len(ids) != length
    if ids.dtype != torch.int64 or ids.dim() != 1 or bad_len or ids.stride(0) != 1:
        want = f"int64 [{length}]" if length is not None else "a 1-d int64 tensor"
        got = f"{ids.dtype} {list(ids.shape)} strides {ids.stride()}"
        raise ValueError(f"{name} must be {want}, contiguous, got {got}")
