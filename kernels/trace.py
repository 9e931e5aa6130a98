"""Per-program timestamps inside kernels, for finding what a step's critical path waits on.

With programmatic dependent launch a kernel starts before the one it waits for ends, so the
profiler's start and duration do not say when its programs became resident, when their wait
returned or when they finished. A bench arms a buffer (`arm`) before one launch; that launch's
kernel then stores, per program, %globaltimer (ns, one clock for every SM) at its start, after
its griddepcontrol.wait and at its end (evals/batch1_trace.py); decode_attention also when its
query and its first tile's K/V have arrived and when that tile is computed (now_after: a read
that waits for a value made from the data, so those stamps cost a reduction each). Unarmed
(always, outside that bench), the kernels compile exactly as without it: TRACE is a constexpr
False (decode_attention: 190 registers for sm_90 either way, 192 traced).

Tracing is not free for every kernel: compiled for sm_90, a traced fused_gemv with a residual
takes more registers (the 1.1B down projection's 4 x 16 tile 58 -> 96, so 2 -> 1 program a SM;
8 x 8 128 -> 223; the o-projection 48 -> 88), so traced GEMV timings are at a lower occupancy
than the engine's. decode_attention (190 -> 192), norm_qkv_rope and gate/up (59 -> 62) barely
change. Compare configurations untraced (evals/engine_ab.py) before trusting a traced GEMV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SLOTS = 8  # int64 stamps a program: start, after the wait, end, then kernel-specific ones
_SLOTS = tl.constexpr(SLOTS)  # the same, as the kernels read it

_armed: list[torch.Tensor] = []


def arm(*bufs: torch.Tensor) -> None:
    """The next traced launches (one buffer each, in launch order) write [programs, SLOTS]
    int64 (start, after the wait, end, then what the kernel adds: decode_attention's query and
    K/V arrivals, first tile done, has keys) into their buffer (CUDA int64, >= SLOTS entries a
    program, zeroed: a slot a kernel does not write stays 0)."""
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
def now_after(dep):
    # %globaltimer once dep (an int32 scalar) is computed: dep is an input of the asm, so the
    # read cannot issue before the loads dep is made from have returned
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def arrived(x):
    # an int32 that depends on every element of x (for now_after)
    return (tl.sum(tl.ravel(x.to(tl.float32)), 0) == 1.2345e-6).to(tl.int32)


@triton.jit
def record(trace_ptr, pid, t_start, t_wait):
    # one program's row: start, after the wait, end (now)
    t_end = now()
    tl.store(trace_ptr + pid * _SLOTS, t_start)
    tl.store(trace_ptr + pid * _SLOTS + 1, t_wait)
    tl.store(trace_ptr + pid * _SLOTS + 2, t_end)


@triton.jit
def stamp(trace_ptr, pid, slot: tl.constexpr, value):
    tl.store(trace_ptr + pid * _SLOTS + slot, value.to(tl.int64))
