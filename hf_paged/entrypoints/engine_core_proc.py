"""The engine process of `hf-paged serve --engine-process`: one Engine and its step loop,
nothing else, so no HTTP work (the event loop, JSON and SSE of every stream, detokenizing)
takes the GIL from a step. run_engine_core is the spawned process's target.

Three threads: the step loop (main), a reader that takes the API process's messages off the
pipe (and ends the process when the pipe closes without a SHUTDOWN: the API process died, so
no orphan keeps the device), and a sender that writes the outputs: a step only appends to the
sender's queue, so a slow reader on the other side never blocks a step; whatever queued up
while a write was in progress goes out as one message.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import traceback

from hf_paged.entrypoints.core_messages import (
    ABORT,
    ACK,
    ADD,
    CALL,
    DEAD,
    FAILED,
    OUTPUTS,
    READY,
    REPLY,
    SHUTDOWN,
    EngineSpec,
)

# engine stats go to the API process at most this often while stepping (its /metrics and
# /health read the latest), and once more when the engine goes idle
STATS_INTERVAL_S = 0.05


def _run_delay() -> float | None:
    """Seconds this thread was runnable but waited for a core (Linux's schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return None


class _Sender(threading.Thread):
    def __init__(self, conn) -> None:
        super().__init__(name="hf-paged-core-sender", daemon=True)
        self.conn = conn
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        self.items.put(item)

    def run(self) -> None:
        items = self.items
        while True:
            batch = [items.get()]
            while True:
                try:
                    batch.append(items.get_nowait())
                except queue.Empty:
                    break
            last = batch[-1] is None  # the loop's end: flush, then stop
            if last:
                batch.pop()
            if batch:
                try:
                    self.conn.send(batch)
                except (OSError, EOFError):  # the API process is gone
                    os._exit(1)
            if last:
                return


def _reader(conn, inbox: queue.SimpleQueue, stopping: threading.Event) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            if stopping.is_set():
                return
            # the API process died (its end of the pipe closed without a SHUTDOWN): nobody
            # can read what this process makes; exit now, even in the middle of loading
            os._exit(1)
        if msg[0] == SHUTDOWN:
            stopping.set()
        inbox.put(msg)
        if msg[0] == SHUTDOWN:
            return


def run_engine_core(spec: EngineSpec, conn_in, conn_out) -> None:
    """Load, build the Engine, report READY (or FAILED with the traceback), then serve."""
    # Ctrl-C in a terminal reaches the whole process group: the API process shuts down
    # gracefully (its open streams still end) and then ends this one
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    stopping = threading.Event()
    threading.Thread(
        target=_reader, args=(conn_in, inbox, stopping), name="hf-paged-core-reader", daemon=True
    ).start()
    try:
        from hf_paged.engine.engine import Engine
        from hf_paged.gc_freeze import frozen_heap
        from hf_paged.lora.layers import adapter_names

        model, tokenizer = spec.load()
        engine = Engine(model, tokenizer, **spec.options)
        if spec.setup is not None:
            spec.setup(engine)
        info = {
            "max_model_len": engine.config.max_model_len,
            "max_num_seqs": engine.config.max_num_seqs,
            "max_seq_tokens": min(
                engine.config.max_model_len, engine.kv.num_blocks * engine.config.block_size
            ),
            "adapter_names": sorted(adapter_names(engine.model)),
            "stats": engine.stats(),
        }
    except BaseException:
        conn_out.send([(FAILED, traceback.format_exc())])
        return
    conn_out.send([(READY, info)])
    sender = _Sender(conn_out)
    sender.start()
    try:
        # the model's heap lives as long as the process: no full collection scans it
        with frozen_heap():
            _CoreLoop(engine, inbox, sender).run()
    finally:
        sender.put(None)
        sender.join(timeout=10)
        engine.shutdown()


class _CoreLoop:
    def __init__(self, engine, inbox: queue.SimpleQueue, sender: _Sender) -> None:
        self.engine, self.inbox, self.sender = engine, inbox, sender
        self.num_lp: dict[str, int] = {}  # logprobs already sent, per request asking for them
        self.stats_due = 0.0
        # what the loop did (benchmarks read them from the stats): steps, wall and CPU time in
        # step(), and (time, steps, step s, step CPU s) at the first and the latest ADD
        self.num_steps = 0
        self.step_s = 0.0
        self.step_cpu_s = 0.0
        self.first_add: tuple | None = None
        self.last_add: tuple | None = None
        self.last_step_end: float | None = None  # time.perf_counter() after the latest step

    def run(self) -> None:
        engine, inbox = self.engine, self.inbox
        while True:
            busy = engine.has_unfinished_requests()
            # take every message that came in; wait for one only when there is nothing to run
            while True:
                try:
                    msg = inbox.get(block=not busy)
                except queue.Empty:
                    break
                if msg[0] == SHUTDOWN:
                    return
                self.handle(msg)
                busy = engine.has_unfinished_requests()
            if not busy:
                continue
            t, cpu = time.perf_counter(), time.thread_time()
            try:
                outputs = engine.step()
            except BaseException:
                self.sender.put((DEAD, traceback.format_exc()))
                return
            self.last_step_end = time.perf_counter()
            self.step_s += self.last_step_end - t
            self.step_cpu_s += time.thread_time() - cpu
            self.num_steps += 1
            now = time.monotonic()
            stats = None
            if now >= self.stats_due or not engine.has_unfinished_requests():
                stats, self.stats_due = self.stats(), now + STATS_INTERVAL_S
            if outputs or stats is not None:
                self.sender.put((OUTPUTS, [self.encode(o) for o in outputs], stats))

    def handle(self, msg) -> None:
        kind = msg[0]
        if kind == ADD:
            _, hid, request_ids, prompts, params = msg
            try:
                self.engine.add_requests(prompts, params, request_ids)
            except ValueError as exc:
                self.sender.put((ACK, hid, str(exc)))
                return
            if params.logprobs is not None:
                for rid in request_ids:
                    self.num_lp[rid] = 0
            self.last_add = (time.perf_counter(), self.num_steps, self.step_s, self.step_cpu_s)
            self.first_add = self.first_add or self.last_add
            self.sender.put((ACK, hid, None))
        elif kind == ABORT:
            for rid in msg[1]:
                try:
                    self.engine.abort(rid)
                except ValueError:  # it ended meanwhile (or with its parent)
                    pass
        elif kind == CALL:
            _, cid, name = msg
            try:
                value = self.call(name)
                self.sender.put((REPLY, cid, True, value))
            except BaseException as exc:
                self.sender.put((REPLY, cid, False, f"{type(exc).__name__}: {exc}"))

    def call(self, name: str):
        engine = self.engine
        if name == "stats":
            return self.stats()
        if name == "idle":
            if engine.has_unfinished_requests():
                return False
            engine.check_invariants()
            free, total = engine.kv.get_num_free_blocks(), engine.kv.num_blocks
            assert free == total, f"{total - free} KV blocks held with no request left"
            return True
        raise ValueError(f"unknown call {name!r}")

    def stats(self) -> dict:
        return {
            **self.engine.stats(),
            "loop": {
                "num_steps": self.num_steps,
                "step_s": self.step_s,
                "step_cpu_s": self.step_cpu_s,
                "first_add": self.first_add,
                "last_add": self.last_add,
                "last_step_end": self.last_step_end,
                "thread_cpu_s": time.thread_time(),  # the step loop thread's, since it started
                "thread_run_delay_s": _run_delay(),  # and its waits for a core (Linux)
            },
        }

    def encode(self, out) -> tuple:
        new = out.new_token_ids
        lps = None
        if out.request_id in self.num_lp and out.logprobs is not None:
            sent = self.num_lp[out.request_id]
            lps = out.logprobs[sent:]
            self.num_lp[out.request_id] = len(out.logprobs)
        if not out.finished:
            return (out.request_id, new, out.num_tokens, lps, None)
        self.num_lp.pop(out.request_id, None)
        end = (
            out.finish_reason,
            out.index,
            out.arrival_time,
            out.first_token_time,
            out.finish_time,
        )
        return (out.request_id, new, out.num_tokens, lps, end)
