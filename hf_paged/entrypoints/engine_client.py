"""The API process's side of `hf-paged serve --engine-process`: the engine runs in a spawned
process of its own (engine_core_proc.py) and EngineProcess stands in for AsyncEngine, with the
same interface to the serving layer (submit -> handle; handle.next_outputs / end_early / close;
stats, alive, on_finished).

Why: in one process the engine's step loop and the HTTP side (uvicorn's event loop, JSON and SSE
of every token of every stream, detokenizing) share the GIL, and the host work of 256 streams
delays every step. Here they only share two pipes. The event loop reads the engine's messages
itself (loop.add_reader: no thread of ours in this process takes the GIL from it): each holds
whole steps' outputs for every request; a handle's unread outputs are merged per request (one
entry however many steps arrived since its coroutine last ran), then its coroutine is woken.

Submitting sends the prompts and returns at once; the engine validates them (prompt lengths,
vocabulary, adapters, grammars: all of Engine.add_request's checks) and acknowledges before any
output of theirs, so `await handle.admitted()` raises the engine's ValueError before a response
starts (a 400). Closing a handle sends an abort for its unfinished requests; their blocks are
freed in the engine process at its next step boundary.

Start-up: the constructor spawns the process, which loads the model from EngineSpec, builds the
Engine and reports READY; a failure there raises EngineStartError here with the child's
traceback (never a hang: a child that dies without a word is noticed too). The child exits when
this process dies (its pipe closes); close() (or interpreter exit) shuts it down cleanly.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence

from hf_paged.entrypoints.core_messages import (
    ABORT,
    ACK,
    ADD,
    CALL,
    CALLS,
    DEAD,
    FAILED,
    OUTPUTS,
    READY,
    REPLY,
    SHUTDOWN,
    CoreOutput,
    EngineSpec,
)
from hf_paged.entrypoints.engine_core_proc import run_engine_core
from hf_paged.entrypoints.fronts import EngineDead, QueueFull, StreamHandle
from hf_paged.request_ids import sibling_request_id

MAX_MESSAGES_PER_READ = 16


class EngineStartError(RuntimeError):
    """The engine process could not start (its traceback is in the message)."""


class CoreRequestHandle(StreamHandle):
    """One HTTP request's engine requests (the interface of async_engine.RequestHandle)."""

    def __init__(
        self,
        front: EngineProcess,
        handle_id: int,
        request_ids: list[str],
        prompts: dict[str, list[int]],
        model_name: str | None,
    ) -> None:
        super().__init__(front, request_ids, model_name)
        self.handle_id = handle_id
        self.prompts = prompts  # request id -> its prompt's token ids
        self._pending: dict[str, CoreOutput] = {}
        self._logprobs: dict[str, list] = {}
        self._admitted = front._loop.create_future()

    async def admitted(self) -> None:
        """Return once the engine queued the requests; its ValueError if it refused them."""
        await asyncio.shield(self._admitted)

    def _ack(self, error: str | None) -> None:
        if self._admitted.done():
            return
        if error is None:
            self._admitted.set_result(None)
        else:
            self._admitted.set_exception(ValueError(error))
            self._admitted.exception()  # retrieved: no "never retrieved" warning if unawaited
            self._unfinished.clear()  # nothing runs in the engine: nothing to abort
            self.front._release(self)

    def _deliver(self, item: tuple) -> None:
        """One output tuple of the engine's (core_messages), on the event loop."""
        rid, new, num_tokens, lps, end = item
        if lps is not None:
            self._logprobs.setdefault(rid, []).extend(lps)
        out = self._pending.get(rid)
        if out is None:
            out = CoreOutput(rid, self.prompts[rid], list(new), num_tokens)
            self._pending[rid] = out
        else:
            out.new_token_ids += new
            out.num_tokens = num_tokens
        if rid in self._logprobs:
            out.logprobs = self._logprobs[rid]
        if end is not None:
            out.finished = True
            out.finish_reason, out.index, out.arrival_time = end[0], end[1], end[2]
            out.first_token_time, out.finish_time = end[3], end[4]

    def _poll(self) -> list[CoreOutput]:
        outs, self._pending = list(self._pending.values()), {}
        return outs

    def _drop(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        # their abort's final outputs are dropped on arrival (not counted as finished
        # requests, as in one process)
        for rid in request_ids:
            self.front._by_rid.pop(rid, None)
        self.front._abort(request_ids)


class EngineProcess:
    """spec: what the engine process builds its Engine from; tokenizer: the same tokenizer,
    loaded in this process (prompts are tokenized and outputs detokenized here)."""

    def __init__(
        self,
        spec: EngineSpec,
        tokenizer,
        max_queued: int = 1024,
        start_timeout_s: float | None = None,
    ) -> None:
        if tokenizer is None:
            raise ValueError("tokenizer: serving needs the model's tokenizer")
        self.tokenizer = tokenizer
        self.error: BaseException | None = None
        self.on_finished: list[Callable[[CoreOutput, str | None], None]] = []
        self.num_handles = 0
        self.num_in_flight = 0
        self._handles: dict[int, CoreRequestHandle] = {}
        self._by_rid: dict[str, CoreRequestHandle] = {}
        self._ids = itertools.count()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._send_lock = threading.Lock()  # the loop and test threads (call()) both send
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = self._ready = False
        # what came back (benchmarks): messages read off the pipe
        self.num_handoffs = 0
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._recv, child_send = ctx.Pipe(duplex=False)
        child_recv, self._send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=run_engine_core,
            args=(spec, child_recv, child_send),
            name="hf-paged-engine-core",
        )
        self.process.start()
        # only the child holds its ends now: its exit closes our reading end (EOF)
        child_recv.close()
        child_send.close()
        atexit.register(self.close)
        try:
            info = self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self._ready = True
        self.max_model_len = info["max_model_len"]
        self.max_seq_tokens = info["max_seq_tokens"]
        self.capacity = info["max_num_seqs"] + max_queued
        self.adapter_names = set(info["adapter_names"])
        self._stats = info["stats"]

    def _wait_ready(self, timeout_s: float | None) -> dict:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._recv.poll(0.1):
            if not self.process.is_alive():
                self.process.join()
                raise EngineStartError(
                    f"the engine process exited with code {self.process.exitcode} before it "
                    "was ready"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartError(f"the engine process was not ready in {timeout_s} s")
        try:
            ((kind, payload),) = self._recv.recv()
        except EOFError:
            self.process.join()
            raise EngineStartError(
                f"the engine process exited with code {self.process.exitcode} before it was ready"
            ) from None
        if kind == FAILED:
            raise EngineStartError(f"the engine process failed to start:\n{payload}")
        assert kind == READY, kind
        return payload

    # -- life ------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Read the engine's messages on `loop` (the running one) from now on."""
        self._loop = loop or asyncio.get_running_loop()
        if self.error is None:
            self._loop.add_reader(self._recv.fileno(), self._on_readable)

    def shutdown(self) -> None:
        """Stop reading on the loop and abort what is left (the engine process stays up:
        close() ends it)."""
        for handle in list(self._handles.values()):
            handle.close()
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._recv.fileno())
            except (ValueError, OSError, RuntimeError):  # closed pipe or loop
                pass
            self._loop = None

    def close(self, timeout_s: float = 30.0) -> None:
        """End the engine process: SHUTDOWN, then terminate if it does not exit in time."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._post((SHUTDOWN,))
        except (OSError, EOFError):
            pass
        # still loading (a start-up given up on: Ctrl-C, an error here): it reads SHUTDOWN only
        # once it serves, so it is terminated at once
        self.process.join(timeout_s if self._ready else 0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._send.close()
        self._recv.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed and self.process.is_alive()

    def stats(self) -> dict:
        """The engine's stats as last pushed (every few steps while it runs, and when it goes
        idle): never a round-trip."""
        return self._stats

    # -- requests --------------------------------------------------------------------------------

    def submit(self, prompts: Sequence[list[int]], params, model_name: str | None = None):
        """Queue the prompts (token ids) with n samples each; `await handle.admitted()` for the
        engine's verdict. Raises QueueFull or EngineDead here."""
        if not self.alive:
            raise EngineDead(f"the engine process is not running ({self.error!r})")
        if self._loop is None:
            raise RuntimeError("EngineProcess.start() first: the event loop reads the outputs")
        wanted = len(prompts) * params.n
        if self.num_in_flight + wanted > self.capacity:
            raise QueueFull(
                f"the server has {self.num_in_flight} sequences in flight, at most "
                f"{self.capacity} (max_num_seqs + max_queued); retry later"
            )
        hid = next(self._ids)
        heads = [f"req-{hid}-{i}" for i in range(len(prompts))]
        request_ids, by_rid = [], {}
        for head, prompt in zip(heads, prompts):
            for k in range(params.n):
                rid = sibling_request_id(head, k)
                request_ids.append(rid)
                by_rid[rid] = prompt
        handle = CoreRequestHandle(self, hid, request_ids, by_rid, model_name)
        self._handles[hid] = handle
        for rid in request_ids:
            self._by_rid[rid] = handle
        self.num_in_flight += len(request_ids)
        self.num_handles += 1
        self._post((ADD, hid, heads, [list(p) for p in prompts], params))
        return handle

    def _release(self, handle: CoreRequestHandle) -> None:
        if handle.closed:
            return
        handle.closed = True
        self.num_in_flight -= len(handle.request_ids)
        self.num_handles -= 1
        self._handles.pop(handle.handle_id, None)
        for rid in handle.request_ids:
            self._by_rid.pop(rid, None)

    def _abort(self, request_ids: list[str]) -> None:
        if self.alive:
            self._post((ABORT, request_ids))

    def _finished(self, out: CoreOutput, model_name: str | None) -> None:
        for hook in self.on_finished:
            hook(out, model_name)

    def _post(self, msg: tuple) -> None:
        with self._send_lock:
            self._send.send(msg)

    # -- introspection -----------------------------------------------------------------------------

    def call(self, name: str, timeout_s: float = 30.0):
        """Ask the engine process (core_messages.CALLS) and wait for the answer. From any thread
        but the event loop's, which must be reading (start()) to receive it."""
        if name not in CALLS:
            raise ValueError(f"name: one of {CALLS}, got {name!r}")
        if self._loop is not None and _running_loop() is self._loop:
            raise RuntimeError("call() would block the event loop that receives its answer")
        cid = next(self._ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[cid] = future
        self._post((CALL, cid, name))
        try:
            return future.result(timeout_s)
        finally:
            self._calls.pop(cid, None)

    def check_idle(self, timeout_s: float = 20.0) -> None:
        """Wait until no request is left on either side, then check the engine's invariants and
        that every KV block is back in the pool (tests, after each one)."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight or not self.call("idle"):
            assert time.monotonic() < deadline, "requests left in the engine"
            time.sleep(0.01)

    # -- the engine's messages, on the event loop ----------------------------------------------

    def _on_readable(self) -> None:
        recv = self._recv
        woken: set[CoreRequestHandle] = set()
        try:
            # at most a few messages per call: an engine that writes faster than this loop
            # reads must not keep the woken coroutines from running (the fd stays readable, so
            # the loop calls back after them; the engine merges what waits meanwhile)
            for _ in range(MAX_MESSAGES_PER_READ):
                if not recv.poll():
                    break
                self.num_handoffs += 1
                for item in recv.recv():
                    self._dispatch(item, woken)
        except (EOFError, OSError):
            self._loop.remove_reader(recv.fileno())
            self.process.join(1)  # it closed its end: it is exiting
            if self.error is None:
                self._fail(EngineDead(f"the engine process exited (code {self.process.exitcode})"))
        for handle in woken:
            handle._event.set()

    def _dispatch(self, item: tuple, woken: set) -> None:
        kind = item[0]
        if kind == OUTPUTS:
            by_rid = self._by_rid
            for out in item[1]:
                handle = by_rid.get(out[0])
                if handle is not None:  # None: a closed handle's request (aborted)
                    handle._deliver(out)
                    woken.add(handle)
            if item[2] is not None:
                self._stats = item[2]
        elif kind == ACK:
            handle = self._handles.get(item[1])
            if handle is not None:
                handle._ack(item[2])
        elif kind == REPLY:
            _, cid, ok, value = item
            future = self._calls.get(cid)
            if future is not None:
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(AssertionError(value))
        elif kind == DEAD:
            self._fail(EngineDead(f"the engine failed:\n{item[1]}"))

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        for handle in list(self._handles.values()):
            handle.error = exc
            if not handle._admitted.done():
                handle._admitted.set_exception(exc)
                handle._admitted.exception()
            handle._event.set()
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(exc)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
