"""Python's GIL switch interval, shortened while a thread beside another one needs the GIL back
quickly: the server's engine loop beside its event loop (entrypoints/async_engine.py), the
grammar's helper thread beside the step loop (structured_output/logits_mask.py). At the default
5 ms a thread waiting for the GIL can wait the other's whole interval.

One holder for the process, since the interval is the process's: each user asks for its
interval and gives it back; the shortest interval asked for holds, and what was there before
the first user comes back when the last one leaves, in whatever order they overlap.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter


class _SwitchInterval:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: Counter[float] = Counter()  # interval asked for -> users holding it
        self._saved = 0.0

    def acquire(self, seconds: float) -> None:
        with self._lock:
            if not self._held:
                self._saved = sys.getswitchinterval()
            self._held[seconds] += 1
            sys.setswitchinterval(min(self._saved, *self._held))

    def release(self, seconds: float) -> None:
        with self._lock:
            self._held[seconds] -= 1
            if self._held[seconds] <= 0:
                del self._held[seconds]
            sys.setswitchinterval(min(self._saved, *self._held) if self._held else self._saved)


switch_interval = _SwitchInterval()
