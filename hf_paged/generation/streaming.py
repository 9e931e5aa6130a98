"""transformers streamers in generate.

LockstepStreamer feeds a transformers streamer (TextStreamer, TextIteratorStreamer, any
BaseStreamer) exactly what transformers' generate feeds it: put(input_ids) once, then put() of
one [batch] tensor per generation step (rows that finished get pad_token_id), then end(). Rows of
the engine do not advance in lockstep (chunked prefill, preemption), so step k is released once
every unfinished row has its k-th token.
"""

from __future__ import annotations

import torch

from hf_paged.core.request import RequestOutput


class LockstepStreamer:
    """Adapts per-request engine outputs to a transformers streamer's batch-per-step calls."""

    def __init__(self, streamer, input_ids: torch.Tensor, row_ids: list[str], pad: int | None):
        self.streamer = streamer
        self.rows = {rid: i for i, rid in enumerate(row_ids)}
        self.tokens: list[list[int]] = [[] for _ in row_ids]
        self.done = [False] * len(row_ids)
        self.pad = 0 if pad is None else pad
        self.released = 0
        self.dtype = input_ids.dtype
        streamer.put(input_ids.cpu())

    def update(self, out: RequestOutput) -> None:
        i = self.rows.get(out.request_id)
        if i is None:
            return
        self.tokens[i].extend(out.new_token_ids)
        self.done[i] = out.finished
        self._release()

    def _release(self) -> None:
        while True:
            k = self.released
            ready = all(len(t) > k or d for t, d in zip(self.tokens, self.done))
            if not ready or all(len(t) <= k for t in self.tokens):
                return
            step = [t[k] if len(t) > k else self.pad for t in self.tokens]
            self.streamer.put(torch.tensor(step, dtype=self.dtype))
            self.released += 1

    def end(self) -> None:
        self._release()
        self.streamer.end()
