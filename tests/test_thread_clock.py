"""The benchmarks' per-thread clocks: CPU seconds of another thread, and collection pauses by
the thread that ran them (evals/thread_clock.py)."""

from __future__ import annotations

import gc
import threading
import time

from hf_paged.testing import load_evals

load_evals()
from hf_paged_evals.thread_clock import GcPauses, thread_cpu_s  # noqa: E402


def test_cpu_seconds_of_a_busy_and_an_idle_thread():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    busy = threading.Thread(target=spin, name="busy")
    idle = threading.Thread(target=stop.wait, name="idle")
    busy.start()
    idle.start()
    try:
        b0, i0 = thread_cpu_s(busy), thread_cpu_s(idle)
        time.sleep(0.3)
        b1, i1 = thread_cpu_s(busy), thread_cpu_s(idle)
    finally:
        stop.set()
        busy.join()
        idle.join()
    assert b1 - b0 > 0.02  # it ran (a shared machine gives it a part of a core at least)
    assert i1 - i0 < 0.01  # it waited
    assert thread_cpu_s() > 0  # this thread's own


def test_collections_are_counted_by_thread_and_full_ones_apart():
    with GcPauses() as pauses:
        gc.collect(0)
        worker = threading.Thread(target=gc.collect, name="collector")
        worker.start()
        worker.join()
    gc.collect()  # outside: not counted
    d = pauses.as_dict()
    assert d["by_thread"][threading.current_thread().name]["count"] >= 1
    assert d["by_thread"]["collector"]["count"] >= 1
    assert d["full"]["count"] >= 1 and d["full"]["count"] <= sum(
        v["count"] for v in d["by_thread"].values()
    )
    assert pauses.seconds >= d["full"]["seconds"] > 0
    assert pauses._callback not in gc.callbacks
