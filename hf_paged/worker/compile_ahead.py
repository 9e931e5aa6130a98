"""Start-up's Triton compiles, all at once on a thread pool instead of one at each first launch.

Triton compiles a kernel variant the first time it is launched, and the launch waits for it. A
start-up meets ~40 variants of hf_paged's kernels (the attention kernels' tile and split
configurations, the small-batch GEMVs at each row count, the sampling graphs' argmax), one after
another: 24.5 s of a 48.7 s cold start-up of the TinyLlama-1.1B shape on the H200, 0.1-1.5 s
each (evals/profiling/startup_kernels.py, 2026-12-02).

CompileAhead runs the same forwards twice. First with Triton's jit_cache_hook answering "skip"
for every variant that is not compiled yet: nothing is compiled or launched (the forwards'
outputs are garbage, and nobody reads them), and the hook records each variant's specialisation.
Then each recorded variant is compiled on a thread pool (JITFunction.preload, as Triton's own
ahead-of-time path does: the same key as the launch, into the in-memory and on-disk caches).
The compiles overlap only in part (much of a compile holds the GIL; ptxas runs as a process of
its own): on the H200 host a variant took ~3.5 s on the pool against ~1.2 s alone, and the 1.1B
shape's cold start-up went from 34.7 to 24.0 s. The second, real run of the forwards finds every
variant compiled.

Only the thread that records is skipped: another thread's launches (another engine's steps, a
user's own kernels) compile and run as usual while the hook is installed.

Only where the on-disk cache is cold: the recording pass and the pool cost a warm start-up
~2.4 s of the 1.1B shape's ~10 s (H200, 2026-12-02), and gain it nothing there. A start-up that
compiled ahead leaves a marker in Triton's cache folder, keyed by everything that decides the
variants (the kernels' sources, Triton, torch, the GPU, the model's config, the engine's
options); a start-up that finds its marker compiles at each first launch, from the cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("hf_paged")


def _runtime_knobs():
    """triton.knobs.runtime where it has the compile hook and JITFunction.preload exists
    (Triton >= 3.4), else None: start-up then compiles at each first launch, as before."""
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return None
    if not hasattr(JITFunction, "preload"):
        return None
    return runtime


class CompileAhead:
    def __init__(self, max_workers: int | None = None) -> None:
        self.runtime = _runtime_knobs()
        self.variants: dict[str, object] = {}  # specialisation (JSON) -> its JITFunction
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.max_workers = max_workers or max(1, min(16, cores))

    @property
    def available(self) -> bool:
        return self.runtime is not None

    @contextmanager
    def recording(self):
        """Inside: this thread's launches of variants not compiled yet are skipped (neither
        compiled nor launched) and recorded."""
        if self.runtime is None:
            yield
            return
        runtime, owner = self.runtime, threading.get_ident()
        previous = runtime.jit_cache_hook

        def hook(**kwargs):
            if threading.get_ident() != owner:
                return previous(**kwargs) if previous is not None else None
            spec = kwargs["compile"]["specialization_data"]
            self.variants.setdefault(spec, kwargs["fn"].jit_function)
            return True  # skip: no compile, no launch

        runtime.jit_cache_hook = hook
        try:
            yield
        finally:
            runtime.jit_cache_hook = previous

    def compile(self) -> int:
        """Compile every recorded variant on the pool; returns how many. A variant that fails
        here is left to its launch, which compiles it again and raises where it belongs."""
        variants, self.variants = list(self.variants.items()), {}
        if not variants:
            return 0

        def one(item) -> bool:
            spec, fn = item
            try:
                fn.preload(spec)
                return True
            except Exception as exc:  # noqa: BLE001 (the launch reports it)
                logger.debug("hf_paged: compile ahead of %s failed: %s", fn, exc)
                return False

        workers = min(self.max_workers, len(variants))
        with ThreadPoolExecutor(workers, thread_name_prefix="hf-paged-compile") as pool:
            done = sum(pool.map(one, variants))
        return done


def warm_marker(parts: list[str]) -> Path | None:
    """The marker a start-up of these parts leaves once it compiled ahead (see the module
    docstring), in Triton's cache folder; None without Triton's cache knobs."""
    try:
        import torch
        import triton
    except ImportError:
        return None
    cache = getattr(getattr(triton, "knobs", None), "cache", None)
    folder = getattr(cache, "dir", None)
    if not folder:
        return None
    import hf_paged.kernels

    digest = hashlib.sha256()
    for source in sorted(Path(hf_paged.kernels.__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for part in [triton.__version__, torch.__version__, device, *parts]:
        digest.update(part.encode())
    return Path(folder) / "hf_paged_compiled_ahead" / digest.hexdigest()
