"""Where an Engine's start-up time goes: seconds per phase, and the CUDA graphs captured.

Engine(model) on the H200 took 12-47 s before any request (TinyLlama-1.1B to Llama-3-8B shapes):
a compile of one decoder layer, the attention kernels' Triton compiles, ~40 CUDA-graph captures.
Each phase is timed where it runs (engine/engine.py, engine/core.py, worker/model_runner.py);
the first compiled forward is counted as "compile" and taken out of the phase it ran in (the KV
sizing's profiling forward on CUDA, else the kernel warm-up), so the phases do not overlap, and
"other" is what no phase covers, so the phases add up to the total exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

# In the order they run. setup: the runner's and the engine core's parts built before and
# around the cache (the model forward's wrappers, the attention backend, the sampler, the block
# pool, the scheduler); fuse_projections: q/k/v and gate/up concatenated; quantize: FP8
# weights; kv_sizing: the K/V shape probe, FP8 scale calibration and the profiling forward that
# sizes the cache on CUDA; compile: torch.compile's first forward (dynamo and inductor, or their
# on-disk caches: docs/startup.md); kv_allocation: the cache and the runner's buffers;
# kernel_warm_up: every attention-kernel variant once; graph_capture: the decode and mixed-step
# CUDA graphs; speculative: the draft model's runner; verify_model: the start-up check.
PHASES = (
    "setup",
    "fuse_projections",
    "quantize",
    "kv_sizing",
    "compile",
    "kv_allocation",
    "kernel_warm_up",
    "graph_capture",
    "speculative",
    "verify_model",
    "other",
)


class StartupTimes:
    """Seconds per phase since construction; `forward` (the runner's ModelForward, once it
    exists) tells how long its first compiled forward took."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.total_seconds: float | None = None  # set by finish()
        self.forward = None
        self.decode_graphs = 0
        self.mixed_graphs = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds or name == "other":
            raise ValueError(f"start-up phase must be one of {PHASES[:-1]}, got {name!r}")
        compiled_before = self._compile_seconds()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            compiled = self._compile_seconds() - compiled_before
            self.seconds[name] += elapsed - compiled
            self.seconds["compile"] += compiled

    def _compile_seconds(self) -> float:
        return self.forward.compile_seconds if self.forward is not None else 0.0

    def finish(self) -> dict:
        """Close the clock (the Engine is built); returns as_dict()."""
        self.total_seconds = time.perf_counter() - self._start
        self.seconds["other"] = 0.0
        self.seconds["other"] = max(0.0, self.total_seconds - sum(self.seconds.values()))
        return self.as_dict()

    def as_dict(self) -> dict:
        """{phase}_s for every phase, total_s, decode_graphs, mixed_graphs: plain numbers."""
        out: dict = {f"{name}_s": s for name, s in self.seconds.items()}
        total = self.total_seconds
        out["total_s"] = total if total is not None else time.perf_counter() - self._start
        out["decode_graphs"] = self.decode_graphs
        out["mixed_graphs"] = self.mixed_graphs
        return out


def format_startup(stats: dict) -> str:
    """One line: the total, then each phase that took time, and the graphs captured."""
    parts = [f"{name.replace('_', ' ')} {stats[f'{name}_s']:.2f}s" for name in PHASES]
    parts = [p for p, name in zip(parts, PHASES) if stats[f"{name}_s"] >= 0.005]
    graphs = stats["decode_graphs"] + stats["mixed_graphs"]
    if graphs:
        parts.append(
            f"{graphs} CUDA graphs ({stats['decode_graphs']} decode + "
            f"{stats['mixed_graphs']} mixed-step)"
        )
    return f"start-up {stats['total_s']:.2f}s: " + ", ".join(parts or ["no phase over 5 ms"])
