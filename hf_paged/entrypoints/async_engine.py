"""The asyncio front over one Engine: any number of coroutines submit, one thread steps.

The engine loop is a thread that calls Engine.step() while requests are live and sleeps
otherwise. Each HTTP request is one Engine.stream() (one engine request per prompt, plus its
n - 1 siblings); its outputs land in the stream's buffer during the step, and after the step
one call_soon_threadsafe per step wakes every coroutine whose stream got something. A coroutine
drains all its outputs at once, so when the event loop falls behind, one SSE chunk carries
several tokens instead of the engine waiting for the HTTP side.

Closing a handle (the client went away, or the response is done) closes its stream: its
unfinished requests are aborted and their blocks freed at once, or at the start of the next step
when one is running. Admission control: at most max_num_seqs + max_queued sequences in flight;
past that, submit raises QueueFull (a 429).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

from hf_paged.core.request import RequestOutput
from hf_paged.engine.engine import Engine
from hf_paged.engine.stream import RequestStream
from hf_paged.sampling_params import SamplingParams


class QueueFull(Exception):
    """More sequences asked for than the waiting queue holds."""


class EngineDead(Exception):
    """The engine loop stopped on an exception: nothing can be served."""


class RequestHandle:
    """One HTTP request's engine requests: their outputs, in arrival order, batch by batch."""

    def __init__(self, front: AsyncEngine, stream: RequestStream, model_name: str | None) -> None:
        self.front = front
        self.stream = stream
        self.model_name = model_name  # the served model the client asked for (metrics' label)
        self.request_ids = list(stream.request_ids)  # choice order: prompt by prompt, n each
        self.index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._unfinished = set(self.request_ids)
        self._event = asyncio.Event()
        self.closed = False
        self.error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _wake(self) -> None:  # on the event loop, after a step delivered to our stream
        self._event.set()

    async def next_outputs(self) -> list[RequestOutput]:
        """Wait for outputs, then return every one delivered so far ([] once all finished)."""
        while True:
            outs = self.stream.poll()
            if outs:
                for out in outs:
                    if out.finished:
                        self._unfinished.discard(out.request_id)
                if self.finished:
                    self.front._release(self)
                return outs
            if self.finished:
                return []
            if self.error is not None:
                raise EngineDead(str(self.error)) from self.error
            self._event.clear()
            await self._event.wait()

    def end_early(self, request_id: str) -> None:
        """This choice is done though the engine still runs it (a stop string the output side
        found first): free it now."""
        if request_id in self._unfinished:
            self._unfinished.discard(request_id)
            self.front.engine.drop_stream(request_id)
            if self.finished:
                self.front._release(self)

    def close(self) -> None:
        """Abort whatever is unfinished and forget the handle (idempotent)."""
        if self.closed:
            return
        self.stream.close()
        self._unfinished.clear()
        self.front._release(self)


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued: int = 1024) -> None:
        if engine.tokenizer is None:
            raise ValueError("tokenizer: serving needs Engine(model, tokenizer)")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.capacity = engine.config.max_num_seqs + max_queued
        self.num_in_flight = 0  # sequences submitted and not finished (event loop thread only)
        self.error: BaseException | None = None
        # metrics hooks: hook(output, the served model name its request asked for)
        self.on_finished: list[Callable[[RequestOutput, str | None], None]] = []
        self._handles: dict[str, RequestHandle] = {}  # request id -> handle (read by the loop)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- life ------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine loop thread; outputs are handed to `loop` (the running one)."""
        self._loop = loop or asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop thread and abort what is left (the Engine itself stays usable)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for handle in list(self._handles.values()):
            handle.close()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self, prompts: Sequence[list[int]], params: SamplingParams, model_name: str | None = None
    ) -> RequestHandle:
        """Queue the prompts (token ids) with n samples each. Raises QueueFull, EngineDead, or
        ValueError (bad input: nothing is queued)."""
        if not self.alive:
            raise EngineDead(f"the engine loop is not running ({self.error!r})")
        wanted = len(prompts) * params.n
        if self.num_in_flight + wanted > self.capacity:
            raise QueueFull(
                f"the server has {self.num_in_flight} sequences in flight, at most "
                f"{self.capacity} (max_num_seqs + max_queued); retry later"
            )
        stream = self.engine.stream(list(prompts), params)
        handle = RequestHandle(self, stream, model_name)
        self.num_in_flight += len(handle.request_ids)
        for rid in handle.request_ids:
            self._handles[rid] = handle
        self._wake.set()
        return handle

    def _release(self, handle: RequestHandle) -> None:
        if handle.closed:
            return
        handle.closed = True
        self.num_in_flight -= len(handle.request_ids)
        for rid in handle.request_ids:
            self._handles.pop(rid, None)

    # -- the loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()  # before the check: a submit after it sets it again
            while not self._stopping and engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except BaseException as exc:  # the engine is in an unknown state: stop serving
                    self.error = exc
                    self._loop.call_soon_threadsafe(self._fail_all, exc)
                    return
                self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        handles = self._handles
        woken = {}
        finished = []
        for out in outputs:
            handle = handles.get(out.request_id)
            if handle is not None:
                woken[id(handle)] = handle
                if out.finished:
                    finished.append((out, handle.model_name))
        if woken or finished:
            self._loop.call_soon_threadsafe(self._deliver, list(woken.values()), finished)

    def _deliver(self, handles: list[RequestHandle], finished: list[tuple]) -> None:
        for handle in handles:
            handle._wake()
        for out, model_name in finished:
            for hook in self.on_finished:
                hook(out, model_name)

    def _fail_all(self, exc: BaseException) -> None:
        for handle in list(self._handles.values()):
            handle.error = exc
            handle._wake()
