"""The asyncio front over one Engine: any number of coroutines submit, one thread steps.

The engine loop is a thread that calls Engine.step() while requests are live and sleeps
otherwise. Each HTTP request is one Engine.stream() (one engine request per prompt, plus its
n - 1 siblings); its outputs land in the stream's buffer during the step. At a hand-off, one
call_soon_threadsafe wakes every coroutine whose stream holds outputs (the engine thread looks at
the live streams then, not at every output of every step: the step loop's own work per step is
the offline engine's plus the routing into buffers), and a coroutine drains all its outputs at
once (one SSE chunk however many tokens).

The two threads share the GIL, and the event loop's work per hand-off grows with the number of
live streams (an event, a write per stream: ~256 of them at a full batch), while the engine's
Python per step does not. Handing off after every step kept the loop busy all the time, and a
busy loop takes the GIL from the engine for a whole switch interval each time the engine lets
it go (a CUDA sync, a kernel launch): at 256 streams the server fell far behind the offline
engine. So hand-offs are paced: at most one per `stream_interval_s` per live stream
(0.5 ms each: one stream is handed every step, 256 streams every ~128 ms, many tokens per
chunk), which bounds the loop's share of the GIL; and while serving, the switch interval is
short, so the engine waits little for the GIL when the loop does hold it.

Closing a handle (the client went away, or the response is done) closes its stream: its
unfinished requests are aborted and their blocks freed at once, or at the start of the next step
when one is running. Admission control: at most max_num_seqs + max_queued sequences in flight;
past that, submit raises QueueFull (a 429).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence

from hf_paged.core.request import RequestOutput
from hf_paged.engine.engine import Engine
from hf_paged.engine.stream import RequestStream
from hf_paged.entrypoints.fronts import STREAM_INTERVAL_S, EngineDead, QueueFull, StreamHandle
from hf_paged.gil_switch import switch_interval
from hf_paged.lora.layers import adapter_names
from hf_paged.sampling_params import SamplingParams

# the interpreter's switch interval while serving (Python's default is 5 ms)
SWITCH_INTERVAL_S = 0.0002


class RequestHandle(StreamHandle):
    """One HTTP request's engine requests: their outputs, in arrival order, batch by batch."""

    def __init__(self, front: AsyncEngine, stream: RequestStream, model_name: str | None) -> None:
        super().__init__(front, list(stream.request_ids), model_name)
        self.stream = stream

    async def admitted(self) -> None:
        """Engine.stream validated the requests in submit(): nothing to wait for."""

    def _wake(self) -> None:  # on the event loop, after a step delivered to our stream
        self._event.set()

    def _poll(self) -> list[RequestOutput]:
        return self.stream.poll()

    def _drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.front.engine.drop_stream(rid)

    def _abort_rest(self) -> None:
        self.stream.close()  # aborts what the stream still runs, and leaves the router


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_queued: int = 1024,
        stream_interval_s: float = STREAM_INTERVAL_S,
    ) -> None:
        if engine.tokenizer is None:
            raise ValueError("tokenizer: serving needs Engine(model, tokenizer)")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        # what one sequence can hold: the smaller of the model length and the whole KV cache
        self.max_seq_tokens = min(
            self.max_model_len, engine.kv.num_blocks * engine.config.block_size
        )
        self.adapter_names = adapter_names(engine.model)  # a PeftModel's LoRA adapters
        self.capacity = engine.config.max_num_seqs + max_queued
        if not stream_interval_s >= 0:
            raise ValueError(f"stream_interval_s: must be >= 0, got {stream_interval_s}")
        self.stream_interval_s = stream_interval_s
        self.num_handles = 0  # live HTTP requests (event loop thread writes, engine thread reads)
        self.num_in_flight = 0  # sequences submitted and not finished (event loop thread only)
        self.error: BaseException | None = None
        # metrics hooks: hook(output, the served model name its request asked for)
        self.on_finished: list[Callable[[RequestOutput, str | None], None]] = []
        # live handles (the loop thread adds and removes; the engine thread reads a snapshot)
        self._handles: set[RequestHandle] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._short_switch = False  # this front holds the short switch interval (gil_switch)
        # what the loop thread did (benchmarks tell an engine slowed by the GIL from lag after)
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time inside Engine.step()
        self.step_cpu_seconds = 0.0  # the engine thread's CPU time inside Engine.step()
        self.num_handoffs = 0
        self._routed = False  # a step returned outputs since the last hand-off (engine thread)
        # (time.perf_counter(), num_steps, step_seconds, step_cpu_seconds) at the first and the
        # latest submit: a benchmark splits the steps taken while requests still arrived
        self.first_submit: tuple | None = None
        self.last_submit: tuple | None = None

    # -- life ------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine loop thread; outputs are handed to `loop` (the running one)."""
        self._loop = loop or asyncio.get_running_loop()
        self._stopping = False
        if not self._short_switch:
            self._short_switch = True
            switch_interval.acquire(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop thread and abort what is left (the Engine itself stays usable)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._short_switch:
            self._short_switch = False
            switch_interval.release(SWITCH_INTERVAL_S)
        for handle in list(self._handles):
            handle.close()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict:
        """Engine.stats(): waits for a step in progress (call it off the event loop)."""
        return self.engine.stats()

    def check_idle(self, timeout_s: float = 20.0) -> None:
        """Wait until neither the engine nor this front holds a request, then check the
        engine's invariants and that every KV block is back in the pool (tests)."""
        engine = self.engine
        deadline = time.monotonic() + timeout_s
        while engine.has_unfinished_requests() or self.num_in_flight:
            assert time.monotonic() < deadline, "requests left in the engine"
            time.sleep(0.01)
        engine.check_invariants()
        assert engine.kv.get_num_free_blocks() == engine.kv.num_blocks

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
        stream = self.engine.stream(list(prompts), params, coalesce=True)
        handle = RequestHandle(self, stream, model_name)
        self.num_in_flight += len(handle.request_ids)
        self.num_handles += 1
        self._handles.add(handle)
        self.last_submit = (
            time.perf_counter(),
            self.num_steps,
            self.step_seconds,
            self.step_cpu_seconds,
        )
        self.first_submit = self.first_submit or self.last_submit
        self._wake.set()
        return handle

    def _release(self, handle: RequestHandle) -> None:
        if handle.closed:
            return
        handle.closed = True
        self.num_in_flight -= len(handle.request_ids)
        self.num_handles -= 1
        self._handles.discard(handle)

    def _finished(self, out: RequestOutput, model_name: str | None) -> None:
        for hook in self.on_finished:
            hook(out, model_name)

    # -- the loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        next_handoff = 0.0
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()  # before the check: a submit after it sets it again
            while not self._stopping and engine.has_unfinished_requests():
                t, cpu = time.perf_counter(), time.thread_time()
                try:
                    outputs = engine.step()
                except BaseException as exc:  # the engine is in an unknown state: stop serving
                    self.error = exc
                    self._handoff()
                    self._loop.call_soon_threadsafe(self._fail_all, exc)
                    return
                self.step_seconds += time.perf_counter() - t
                self.step_cpu_seconds += time.thread_time() - cpu
                self.num_steps += 1
                self._routed |= bool(outputs)
                now = time.monotonic()
                if now >= next_handoff:
                    self._handoff()
                    next_handoff = now + self.stream_interval_s * self.num_handles
            self._handoff()  # idle (or stopping): nothing waits for a later step

    def _handoff(self) -> None:
        """Wake, on the event loop, every live handle whose stream holds outputs, if a step
        routed any since the last hand-off."""
        if not self._routed:
            return
        self._routed = False
        # tuple(): a snapshot taken in one C call under the GIL (the loop thread adds and
        # removes handles meanwhile)
        woken = [h for h in tuple(self._handles) if h.stream.has_outputs]
        if woken:
            self.num_handoffs += 1
            self._loop.call_soon_threadsafe(self._deliver, woken)

    @staticmethod
    def _deliver(handles: list[RequestHandle]) -> None:
        for handle in handles:
            handle._wake()

    def _fail_all(self, exc: BaseException) -> None:
        for handle in list(self._handles):
            handle.error = exc
            handle._wake()
