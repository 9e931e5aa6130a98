"""Where a benchmark's host time went, per thread: CPU seconds and garbage-collection pauses.

A step that takes longer in the server than offline is either more work on the engine thread
(its CPU seconds per step grow) or the engine waiting (for the GIL another thread holds, or for a
core on a busy machine): the CPU clocks tell the two apart. A collection holds the GIL for its
whole pass, whichever thread's allocation set it off, so every thread waits through it: GcPauses
adds them up by the thread that ran them.
"""

from __future__ import annotations

import gc
import threading
import time


def thread_cpu_s(thread: threading.Thread | None = None) -> float:
    """CPU seconds `thread` (default: this one) has used; needs a live thread."""
    if thread is None or thread is threading.current_thread():
        return time.thread_time()
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class GcPauses:
    """Collections while inside the `with`: {thread name: [count, seconds]}, and the full
    (generation 2) ones apart: they scan every object not frozen, the young ones do not."""

    def __init__(self) -> None:
        self.by_thread: dict[str, list] = {}
        self.full = [0, 0.0]
        self._started: dict[int, float] = {}

    def _callback(self, phase: str, info: dict) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.perf_counter()
            return
        t0 = self._started.pop(ident, None)
        if t0 is not None:
            entry = self.by_thread.setdefault(threading.current_thread().name, [0, 0.0])
            seconds = time.perf_counter() - t0
            for e in (entry, self.full) if info["generation"] == 2 else (entry,):
                e[0] += 1
                e[1] += seconds

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.by_thread.values())

    def as_dict(self) -> dict:
        by = {name: {"count": n, "seconds": s} for name, (n, s) in self.by_thread.items()}
        return {"by_thread": by, "full": {"count": self.full[0], "seconds": self.full[1]}}

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)
