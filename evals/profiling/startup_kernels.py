"""Which Triton compiles a cold start-up pays for, and in which phase: every JIT kernel variant
compiled while `Engine(model)` starts (hf_paged's kernels; inductor's own go through its
compile workers and show as the `compile` phase), with its compile seconds and specialisation.

Run in a fresh process with empty caches (the script points the compile caches at a new
temporary folder, envs.use_compile_cache, unless --keep-caches or the user set them):

    python evals/profiling/startup_kernels.py --shape tinyllama-1.1b

Prints the start-up breakdown, then per phase the compiles by kernel (variants, seconds), then
the 40 slowest variants with the argument specialisations that told them apart (a value of 1 or
a multiple of 16 in an integer argument makes its own variant unless the kernel says
do_not_specialize).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tinyllama-1.1b")
    ap.add_argument("--keep-caches", action="store_true", help="use the default cache folders")
    ap.add_argument("--top", type=int, default=40)
    args, rest = ap.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    if not args.keep_caches:  # empty folders, before anything compiles (hf_paged/envs.py)
        from hf_paged import envs

        root = tempfile.mkdtemp(prefix="hf-paged-startup-")
        if len(envs.use_compile_cache(root)) < 2:
            print("note: TRITON_CACHE_DIR or TORCHINDUCTOR_CACHE_DIR is set: not a cold start")

    import bench_setup  # noqa: F401  (evals as hf_paged_evals)
    import triton
    from bench_setup import add_engine_options, build_model, engine_options

    extra = argparse.ArgumentParser()
    add_engine_options(extra)
    opts = engine_options(extra.parse_args(rest))

    import hf_paged
    from hf_paged.worker import startup_times

    phase_now = ["before"]
    original_phase = startup_times.StartupTimes.phase

    def phase(self, name):
        inner = original_phase(self, name)

        class Tracked:
            def __enter__(self_):
                phase_now.append(name)
                return inner.__enter__()

            def __exit__(self_, *exc):
                phase_now.pop()
                return inner.__exit__(*exc)

        return Tracked()

    startup_times.StartupTimes.phase = phase
    started: dict = {}
    compiles = []  # (phase, kernel, seconds, specialisation)

    def before(*, key, **_):
        started[id(key)] = time.perf_counter()
        return False

    def after(*, key, repr, fn, **_):
        t0 = started.pop(id(key), None)
        if t0 is not None:
            # repr names each argument's specialisation on some Triton versions only; the key
            # always holds it (the signature with its 1 / multiple-of-16 marks, the constexprs)
            spec = f"{repr} key={key}"
            compiles.append(
                (phase_now[-1], getattr(fn, "name", str(fn)), time.perf_counter() - t0, spec)
            )
        return False

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        raise SystemExit(f"triton {triton.__version__} has no knobs.runtime compile hooks")
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after

    t0 = time.perf_counter()
    model = build_model(args.shape)
    load = time.perf_counter() - t0
    engine = hf_paged.Engine(model, **opts)
    stats = engine.startup_stats
    print(f"{args.shape}: load {load:.2f}s; " + startup_times.format_startup(stats))
    total = sum(c[2] for c in compiles)
    print(f"{len(compiles)} Triton JIT compiles, {total:.1f}s in all")
    by_phase: dict = defaultdict(lambda: defaultdict(list))
    for ph, name, secs, _ in compiles:
        by_phase[ph][name].append(secs)
    for ph, kernels in by_phase.items():
        secs = sum(sum(v) for v in kernels.values())
        print(f"\nphase {ph}: {sum(len(v) for v in kernels.values())} compiles, {secs:.1f}s")
        for name, v in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {len(v):4d} x  {sum(v):6.2f}s  {name}")
    print(f"\nthe {args.top} slowest compiles:")
    for ph, name, secs, spec in sorted(compiles, key=lambda c: -c[2])[: args.top]:
        print(f"  {secs:5.2f}s  {ph:15s} {spec[:1500]}")
    engine.shutdown()


if __name__ == "__main__":
    main()
