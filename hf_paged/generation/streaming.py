"""Streaming: the Engine's iterator over many requests, and transformers streamers in generate.

RequestStream drives Engine.step and yields each RequestOutput as soon as one of its requests
gets a token, so many requests stream interleaved through continuous batching.

LockstepStreamer feeds a transformers streamer (TextStreamer, TextIteratorStreamer, any
BaseStreamer) exactly what transformers' generate feeds it: put(input_ids) once, then put() of
one [batch] tensor per generation step (rows that finished get pad_token_id), then end(). Rows of
the engine do not advance in lockstep (chunked prefill, preemption), so step k is released once
every unfinished row has its k-th token.
"""

from __future__ import annotations

from collections import deque

import torch

from hf_paged.core.request import RequestOutput


class RequestStream:
    """Iterator of RequestOutput for a set of queued requests (see Engine.stream). Closing it, or
    leaving its `with` block, before the end aborts the requests that have not finished.

    Any thread's Engine.step() delivers this stream's outputs into its buffer (deliver). When the
    buffer is empty, the iterating thread steps the engine itself, or waits while another
    waiting thread does (Engine._wait_or_step): concurrent streams share the steps."""

    def __init__(self, engine, request_ids: list[str]) -> None:
        self.engine = engine
        self.request_ids = list(request_ids)
        self._remaining = set(request_ids)
        self._buffer: deque[RequestOutput] = deque()

    def deliver(self, out: RequestOutput) -> None:
        """Called by Engine.step (under the engine's lock) for each output of our requests."""
        self._buffer.append(out)
        if out.finished:
            self._remaining.discard(out.request_id)

    def poll(self) -> list[RequestOutput]:
        """The outputs delivered so far and not yet taken, without stepping the engine (for a
        caller whose requests are stepped by someone else: another thread, a server loop)."""
        out = []
        while self._buffer:
            out.append(self._buffer.popleft())
        return out

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        while True:
            if self._buffer:
                return self._buffer.popleft()
            if not self._remaining:  # deliver() appends before it discards: nothing is lost
                if self._buffer:
                    continue
                raise StopIteration
            self.engine._wait_or_step(self._ready)

    def _ready(self) -> bool:
        return bool(self._buffer) or not self._remaining

    def close(self) -> None:
        engine = self.engine
        for rid in sorted(self._remaining):
            engine._streams.pop(rid, None)
            try:
                engine._abort(rid, report=False)
            except ValueError:  # ended meanwhile (or a sibling ended with its parent)
                pass
        self._remaining.clear()
        self._buffer.clear()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._remaining and not self.engine._closed:
                self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass


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
