"""The Engine's iterator over many requests: RequestStream drives Engine.step and yields each
RequestOutput as soon as one of its requests gets a token, so many requests stream interleaved
through continuous batching."""

from __future__ import annotations

import threading
from collections import deque

from hf_paged.core.request import RequestOutput


class RequestStream:
    """Iterator of RequestOutput for a set of queued requests (see Engine.stream). Closing it, or
    leaving its `with` block, before the end aborts the requests that have not finished.

    Any thread's Engine.step() delivers this stream's outputs into its buffer (deliver). When the
    buffer is empty, the iterating thread steps the engine itself, or waits while another
    waiting thread does (Engine.wait_or_step): concurrent streams share the steps.

    coalesce (for a consumer that polls every few steps, as the server does): a request's
    outputs not taken yet are merged into one, the latest, whose new_token_ids holds every token
    since the last take. Without it, each step's output of each request stays alive until taken
    (256 streams taken every 30 steps: ~8k objects), and the garbage collector's young
    collections, which run about once per step then, scan and promote them all. The merge
    updates the latest output in place: the caller of Engine.step must not read the outputs
    it routes to such a stream (the server's engine loop does not)."""

    def __init__(self, engine, request_ids: list[str], coalesce: bool = False) -> None:
        self.engine = engine
        self.request_ids = list(request_ids)
        self._remaining = set(request_ids)
        self._buffer: deque[RequestOutput] = deque()
        # coalesce: request id -> its pending output, under a lock (deliver and poll run on
        # different threads, and a merge reads then replaces)
        self._pending: dict[str, RequestOutput] | None = {} if coalesce else None
        self._lock = threading.Lock()

    def deliver(self, out: RequestOutput) -> None:
        """Called by Engine.step (under the engine's lock) for each output of our requests."""
        if self._pending is None:
            self._buffer.append(out)
        else:
            with self._lock:
                prev = self._pending.pop(out.request_id, None)
                if prev is not None:  # earlier tokens first, in the earlier output's own list
                    prev.new_token_ids += out.new_token_ids
                    out.new_token_ids = prev.new_token_ids
                self._pending[out.request_id] = out
        if out.finished:
            self._remaining.discard(out.request_id)

    @property
    def has_outputs(self) -> bool:
        """Outputs delivered and not taken yet (any thread may ask)."""
        return bool(self._buffer if self._pending is None else self._pending)

    def poll(self) -> list[RequestOutput]:
        """The outputs delivered so far and not yet taken, without stepping the engine (for a
        caller whose requests are stepped by someone else: another thread, a server loop);
        coalesced: one per request, in the order their tokens last came."""
        if self._pending is not None:
            with self._lock:
                out, self._pending = list(self._pending.values()), {}
            return out
        out = []
        while self._buffer:
            out.append(self._buffer.popleft())
        return out

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        while True:
            if self._pending:  # a coalescing stream iterated: what is pending joins the queue
                self._buffer.extend(self.poll())
            if self._buffer:
                return self._buffer.popleft()
            if not self._remaining:  # deliver() appends before it discards: nothing is lost
                if self._buffer:
                    continue
                raise StopIteration
            self.engine.wait_or_step(self._ready)

    def collect(self, use_tqdm: bool = False) -> list[RequestOutput]:
        """Iterate to the end; the final output of each request, in request_ids order. A
        request's own user code that raised is raised here (the stream's close() then aborts
        the others); a request aborted by someone else raises RuntimeError."""
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self.request_ids), desc="hf_paged", unit="req")
        try:
            for out in self:
                if out.error is not None:
                    raise out.error
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        missing = [
            rid
            for rid in self.request_ids
            if rid not in final or final[rid].finish_reason == "abort"
        ]
        if missing:
            raise RuntimeError(f"requests {missing[:5]} were aborted before they finished")
        return [final[rid] for rid in self.request_ids]

    def _ready(self) -> bool:
        return self.has_outputs or bool(self._buffer) or not self._remaining

    def close(self) -> None:
        engine = self.engine
        for rid in sorted(self._remaining):
            engine.drop_stream(rid)
        self._remaining.clear()
        self._buffer.clear()
        if self._pending is not None:
            with self._lock:
                self._pending = {}

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._remaining and not self.engine.closed:
                self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass


class StreamRouter:
    """Which RequestStream each request's outputs go to (Engine.step routes every output)."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}

    def register(self, request_ids: list[str], stream: RequestStream) -> None:
        for rid in request_ids:
            self._streams.setdefault(rid, stream)

    def unregister(self, request_ids: list[str], stream: RequestStream) -> None:
        for rid in request_ids:
            if self._streams.get(rid) is stream:
                del self._streams[rid]

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def request_ids(self) -> set[str]:
        return set(self._streams)

    def route(self, outputs: list[RequestOutput]) -> bool:
        """Deliver each output to its stream; True if any was delivered."""
        streams = self._streams
        if not streams:
            return False
        delivered = False
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:
                stream.deliver(out)
                delivered = True
                if out.finished:
                    del streams[out.request_id]
        return delivered
