"""Keep Python's full garbage collections of the pre-run heap out of a generate call, and
every collection out of an Engine's start-up.

A process that imported torch and transformers and built a model tracks ~400k objects. CPython
runs a full (generation-2) collection whenever enough objects have survived younger ones, and a
full collection scans every tracked object: ~200 ms on this project's 2-core CI machine
(evals/profiling/host_overhead.py --freeze 0). The step loop allocates steadily (request
outputs, token lists), so a full collection can land in the middle of a run whose steps take
~2 ms.

`frozen_heap()` freezes the objects that exist when it is entered (`gc.freeze`: moved where the
collector never scans) and unfreezes them when it exits, however it exits: collections inside
scan only what the run made, and afterwards nothing stays exempt. Engine.generate runs inside
it; a caller stepping the engine itself can use it the same way. Nested and concurrent calls
(threads) share the outermost freeze; it does nothing when the caller froze objects already, or
when the collector is off.

`collections_paused()` turns the collector off while an Engine starts: torch.compile's tracing
and code generation make hundreds of thousands of objects, and each full collection they set off
scans the whole heap. On the H200's host a TinyLlama-1.1B start-up spent 2.4 s of its 27 s in
collections with empty compile caches (4 full ones, ~0.5 s each) and 0.65 s with warm ones
(evals/RESULTS.md, engine start-up). On the way out one young-generation collection runs (part
of the start-up's time, not the first request's); the start-up's cyclic garbage waits for the
next full collection.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_depth = 0  # frozen_heap() calls in progress, in any thread: the first in freezes, the last out
_lock = threading.Lock()  # unfreezes (concurrent generate calls share one freeze)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    global _depth, _mine
    with _lock:
        if _depth == 0:
            _mine = gc.isenabled() and gc.get_freeze_count() == 0
            if _mine:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _mine:
                gc.unfreeze()


_mine = False  # the outermost frozen_heap() froze the heap (and so unfreezes it)


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No garbage collection inside (process-wide: gc.disable); as it was on the way out. A
    collector already off stays off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect(0)  # the young objects the start-up left: here, not in the first request
