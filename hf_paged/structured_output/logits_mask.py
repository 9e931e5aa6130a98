"""The sampler's one structured output hook: grammar matchers -> token bitmask -> masked logits.

Each constrained row (a SamplingRow with a RowMatcher) first catches its matcher up with the
row's output tokens (one accept per token since its last step; a row rebuilt after preemption
replays every output token, so recompute needs no rollback), then the step's constrained rows
fill their rows of an int32 bitmask [rows, ceil(V / 32)] on the host (xgrammar's batch fill),
which goes to the logits' device in one copy and is applied by one kernel
(xgrammar.apply_token_bitmask_inplace: CUDA/Triton on a GPU, its C++ loop on the CPU) on the
constrained rows only. Unconstrained rows are not read or written; a step without a constrained
row never gets here (the sampler checks the F_STRUCTURED bit).

The mask is applied to the raw logits, before penalties, temperature and the top-k/top-p/min-p
filters: the draw is from the model's distribution restricted to the grammar's tokens, and
recorded logits/logprobs of a constrained row are of that masked distribution.
"""

from __future__ import annotations

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

    def catch_up(self, token_ids: list[int], num_prompt_tokens: int) -> int | None:
        """Accept the row's output tokens the matcher has not seen. Returns the first token the
        grammar refuses (the matcher stays before it), or None."""
        start = num_prompt_tokens + self.num_accepted
        for token in token_ids[start:]:
            if not self.matcher.accept_token(token):
                return token
            self.num_accepted += 1
        return None


class GrammarBitmask:
    """Owned by the sampler: the host bitmask buffer (pinned on a GPU, grown on demand)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None
        self._batch = None  # xgrammar.BatchGrammarMatcher, made on first use

    def apply(self, logits: torch.Tensor, rows: list, failed: dict) -> None:
        """Mask logits [B, V] in place for the rows with a matcher. A row whose last token the
        grammar refuses (another option masked every allowed token) fails alone, into failed."""
        xgr = import_xgrammar()
        sel, matchers = [], []
        for i, row in enumerate(rows):
            state = row.structured
            if state is None:
                continue
            refused = state.catch_up(row.token_ids, row.num_prompt_tokens)
            if state.matcher.is_terminated():
                # it sampled a stop token: it has ended, and this step's token (asynchronous
                # scheduling ran it one step ahead) is dropped by the scheduler
                continue
            if refused is not None:
                failed[row.req_id] = ValueError(
                    f"structured: token {refused} is not allowed by the request's grammar: "
                    "every allowed token was masked (by an option such as min_tokens or "
                    "bad_words_ids, or no token spells the grammar's next character)"
                )
                continue
            sel.append(i)
            matchers.append(state.matcher)
        if not sel:
            return
        num_rows, vocab = logits.shape
        bitmask = self._buffer(num_rows, (vocab + 31) // 32)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, sel)
        if logits.device.type != "cpu":
            # the pinned buffer is reused: the previous step's copy has finished, since the host
            # read that step's tokens (sampled after the copy on the same stream) before this
            bitmask = bitmask.to(logits.device, non_blocking=True)
        indices = None if len(sel) == num_rows else sel
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)

    def _buffer(self, num_rows: int, width: int) -> torch.Tensor:
        host = self._host
        if host is None or host.shape[0] < num_rows or host.shape[1] != width:
            rows = max(num_rows, 2 * host.shape[0] if host is not None else 8)
            pin = self.device.type == "cuda"
            host = torch.empty((rows, width), dtype=torch.int32, pin_memory=pin)
            self._host = host
        return host[:num_rows]
