"""The sampler's one structured output hook: grammar matchers -> token bitmask -> masked logits.

Two parts:

prepare (host only, GrammarBitmask.prepare): each constrained row catches its matcher up with
  the row's output tokens (usually one token a row: one batched accept for all of them; a row
  rebuilt after preemption replays every output token, so recompute needs no rollback), then the
  rows fill their rows of an int32 bitmask [rows, ceil(V / 32)] (xgrammar's batch fill, on
  several threads). Under asynchronous scheduling the runner defers a constrained step's
  sampling so that this runs while the GPU computes that step's forward (model_runner.py,
  ModelRunner._defer_sampling, has the order).
apply (GrammarBitmask.apply): one host-to-device copy and one kernel
  (xgrammar.apply_token_bitmask_inplace: CUDA/Triton on a GPU, its C++ loop on the CPU) on the
  constrained rows only. Unconstrained rows are not read or written; a step without a
  constrained row never gets here (the sampler checks the F_STRUCTURED bit).

The mask is applied to the raw logits, before penalties, temperature and the top-k/top-p/min-p
filters: the draw is from the model's distribution restricted to the grammar's tokens, and
recorded logits/logprobs of a constrained row are of that masked distribution.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from hf_paged.structured_output.constraint import import_xgrammar


class RowMatcher:
    """A running row's grammar state. stop_token_ids: the request's end-of-sequence and stop
    ids, the only tokens the grammar allows once it is complete (sampling one ends the request,
    and the scheduler's stop check ends it as for any request)."""

    __slots__ = ("matcher", "num_accepted")

    def __init__(self, compiled, stop_token_ids) -> None:
        xgr = import_xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))
        self.num_accepted = 0  # output tokens the matcher has consumed

    def unseen(self, token_ids: list[int], num_prompt_tokens: int) -> list[int]:
        """The row's output tokens the matcher has not accepted yet."""
        return token_ids[num_prompt_tokens + self.num_accepted :]

    def accept(self, tokens: list[int]) -> int | None:
        """Accept tokens one by one. Returns the first token the grammar refuses (the matcher
        stays before it), or None."""
        for token in tokens:
            if not self.matcher.accept_token(token):
                return token
            self.num_accepted += 1
        return None


@dataclass(slots=True)
class GrammarMask:
    """A step's bitmask on the host: rows[k] of the sampler's rows is constrained by
    bitmask[k]; failed: request id -> why its row cannot go on (a refused token)."""

    bitmask: torch.Tensor | None  # int32 [num_rows, ceil(V / 32)]; None: no row to mask
    sel: list[int]
    num_rows: int
    failed: dict = field(default_factory=dict)


def fill_threads() -> int:
    """Threads for the batch fill: half the cores this process may use, at most 8. (xgrammar's
    'auto' takes half of std::thread::hardware_concurrency(), every core of the host, which
    oversubscribes a container that is given a few of them.)"""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


class GrammarBitmask:
    """Owned by the sampler: the host bitmask buffer (pinned on a GPU, grown on demand) and the
    batch matcher."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None
        self._batch = None  # xgrammar.BatchGrammarMatcher, made on first use

    def prepare(self, rows: list, vocab: int) -> GrammarMask:
        """Catch the rows' matchers up with their histories and fill their bitmask."""
        xgr = import_xgrammar()
        failed = {}
        sel, matchers, news = [], [], []
        for i, row in enumerate(rows):
            state = row.structured
            if state is None:
                continue
            sel.append(i)
            matchers.append(state)
            news.append(state.unseen(row.token_ids, row.num_prompt_tokens))
        refused = self._accept(xgr, matchers, news)
        keep_sel, keep = [], []
        for i, state, bad in zip(sel, matchers, refused):
            row = rows[i]
            if state.matcher.is_terminated():
                # it sampled a stop token: it has ended, and this step's token (asynchronous
                # scheduling ran it one step ahead) is dropped by the scheduler
                continue
            if bad is not None:
                failed[row.req_id] = ValueError(
                    f"structured: token {bad} is not allowed by the request's grammar: "
                    "every allowed token was masked (by an option such as min_tokens or "
                    "bad_words_ids, or no token spells the grammar's next character)"
                )
                continue
            keep_sel.append(i)
            keep.append(state.matcher)
        if not keep_sel:
            return GrammarMask(None, [], len(rows), failed)
        bitmask = self._buffer(len(rows), (vocab + 31) // 32)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=fill_threads())
        self._batch.batch_fill_next_token_bitmask(keep, bitmask, keep_sel)
        return GrammarMask(bitmask, keep_sel, len(rows), failed)

    @staticmethod
    def _accept(xgr, states: list[RowMatcher], news: list[list[int]]) -> list[int | None]:
        """Each row's refused token or None. One batched call when every row has one new
        token (every decode step after the first); a row replaying its history loops."""
        if states and all(len(n) == 1 for n in news):
            oks = xgr.BatchGrammarMatcher.batch_accept_token(
                [s.matcher for s in states], [n[0] for n in news]
            )
            refused = []
            for state, new, ok in zip(states, news, oks):
                state.num_accepted += ok
                refused.append(None if ok else new[0])
            return refused
        return [state.accept(new) for state, new in zip(states, news)]

    def apply(self, logits: torch.Tensor, mask: GrammarMask) -> None:
        """Mask logits [B, V] in place on mask's rows."""
        if mask.bitmask is None:
            return
        bitmask = mask.bitmask
        if logits.device.type != "cpu":
            # the pinned buffer is reused: the previous step's copy has finished, since this
            # step's bitmask was filled after the host read that step's tokens (sampled after
            # the copy on the same stream)
            bitmask = bitmask.to(logits.device, non_blocking=True)
        num_rows, vocab = logits.shape
        indices = None if len(mask.sel) == num_rows else mask.sel
        import_xgrammar().apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=vocab, indices=indices
        )

    def _buffer(self, num_rows: int, width: int) -> torch.Tensor:
        host = self._host
        if host is None or host.shape[0] < num_rows or host.shape[1] != width:
            rows = max(num_rows, 2 * host.shape[0] if host is not None else 8)
            pin = self.device.type == "cuda"
            host = torch.empty((rows, width), dtype=torch.int32, pin_memory=pin)
            self._host = host
        return host[:num_rows]
