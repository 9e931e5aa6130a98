"""Per-program timestamps inside kernels, for finding what a step's critical path waits on.

With programmatic dependent launch a kernel starts before the one it waits for ends, so the
profiler's start and duration do not say when its programs became resident, when their wait
returned or when they finished. A bench arms a buffer (`arm`) before one launch; that launch's
kernel then stores, per program, %globaltimer (ns, one clock for every SM) at its start, after
its griddepcontrol.wait and at its end (evals/batch1_trace.py). Unarmed (always, outside that
bench), the kernels compile exactly as without it: TRACE is a constexpr False.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_armed: list[torch.Tensor] = []


def arm(*bufs: torch.Tensor) -> None:
    """The next traced launches (one buffer each, in launch order) write [programs, 4] int64
    (start, after the wait, end, unused) into their buffer (CUDA int64, >= 4 entries a
    program)."""
    _armed.extend(bufs)


def take() -> dict:
    """Launch kwargs for the kernel about to launch: the first armed buffer, once."""
    return {"TRACE": True, "trace_ptr": _armed.pop(0)} if _armed else {}


@triton.jit
def now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def record(trace_ptr, pid, t_start, t_wait):
    # one program's row: start, after the wait, end (now)
    t_end = now()
    tl.store(trace_ptr + pid * 4, t_start)
    tl.store(trace_ptr + pid * 4 + 1, t_wait)
    tl.store(trace_ptr + pid * 4 + 2, t_end)
