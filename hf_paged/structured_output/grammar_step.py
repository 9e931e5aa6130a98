"""A step's grammar work on a helper thread, overlapping the forward and the step loop's thread.

Under asynchronous scheduling the bitmask of step n+1 needs step n's tokens, which reach the host
as step n+1's forward starts. The order (ModelRunner.execute, EngineCore._step_async):

  step loop's thread                        helper thread               GPU
  launch forward n+1; submit its job  ->    wait for n's tokens         sample n, forward n+1
  handle step n's output (scheduler         accept n's tokens (one      forward n+1
    update, stop checks, outputs),            batched call), fill n+1's
    schedule n+2, prepare its inputs          bitmask (several threads)
  join; queue mask + sample n+1, then                                   mask, sample n+1,
    launch forward n+2; submit its job ...                              forward n+2

so the grammar's host work runs beside the step loop's own host work (xgrammar releases the GIL
while it accepts and fills), both beside the forward, and the GPU goes from sampling n+1 to
forward n+2 without waiting for the host's scheduling. The step loop waits only for what is left
of the job when it needs the bitmask. One job at a time: the next is submitted after this one
is joined, so the matchers and the bitmask buffer have one user at a time.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hf_paged.structured_output.logits_mask import GrammarBitmask, GrammarMask


class GrammarStep:
    def __init__(self, grammar: GrammarBitmask) -> None:
        self.grammar = grammar
        self._pool: ThreadPoolExecutor | None = None  # started on first use

    def submit(self, rows: list, vocab: int, row_ids, epochs, previous=None) -> Future:
        """Prepare the bitmask of rows (the step's sampling rows; row_ids and epochs: their
        InputBatch rows and those rows' epochs at launch) on the helper thread. previous: the
        launched step before (an async_output.PendingOutput) whose tokens the matchers must
        accept first; the helper waits for them."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_paged-grammar")
        rows = list(rows)
        return self._pool.submit(self._prepare, rows, vocab, row_ids, epochs, previous)

    def _prepare(self, rows, vocab, row_ids, epochs, previous) -> GrammarMask:
        landed = None
        if previous is not None:
            landed = landed_tokens(previous, row_ids, epochs)
        return self.grammar.prepare(rows, vocab, landed)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def landed_tokens(previous, row_ids: np.ndarray, epochs: np.ndarray) -> dict:
    """index into row_ids -> (position, token) of the previous step's token for that row, for
    the rows still held by the request that sampled it (same row, same epoch)."""
    if previous.deferred is not None:  # its tokens would never come
        raise RuntimeError("a deferred sampling must be launched before its tokens are read")
    tokens = previous.wait()
    if tokens is None:
        return {}
    prev = {
        (int(r), int(e)): (int(p), int(t))
        for r, e, p, t in zip(previous.rows, previous.epochs, previous.positions, tokens)
        if t >= 0
    }
    out = {}
    for i, (r, e) in enumerate(zip(row_ids.tolist(), epochs.tolist())):
        hit = prev.get((r, e))
        if hit is not None:
            out[i] = hit
    return out
