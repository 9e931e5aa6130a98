"""Where a speculative step's time goes at small batches: target + draft shapes with random
weights, acceptance controlled as `evals/run.py spec` does (ControlledAcceptance), one run of
`--batch` requests.

Prints, per verify step: wall time and its host phases (schedule, the target's forward up to its
logits, the rejection sampler, the draft's proposals, the rest of the runner's and the engine's
work) measured with perf_counter around the engine's own methods; then a torch.profiler window of
`--window` steps: GPU busy per step (union of kernel intervals), kernels per step, the kernels by
time, and (--cprofile) the host's Python frames. A plain (k = 0) run of the same requests first,
for the decode step it is compared with.

    python evals/profiling/spec_profile.py --shape llama-3-8b --draft smollm2-135m --alpha 0.8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time
from collections import defaultdict

import bench_setup  # noqa: F401  (evals as hf_paged_evals)
import torch
from bench_setup import add_engine_options, build_model, engine_options, gpu_busy_us, kernel_rows
from engine_bench import timeline
from hf_paged_evals.spec_bench import ControlledAcceptance


class PhaseClock:
    """Wall seconds spent inside named callables (wrapped in place, restored by undo())."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo = []

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        seconds = self.seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - t0

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def undo(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def run(engine, prompts, max_new: int, tag: str) -> tuple[float, int]:
    from hf_paged import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{tag}-{i}")
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--draft", default="smollm2-135m")
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--window", type=int, default=20, help="verify steps under torch.profiler")
    ap.add_argument("--cprofile", action="store_true", help="Python frames of the window")
    add_engine_options(ap)
    args = ap.parse_args()

    import hf_paged
    from hf_paged.worker import model_runner, verify_step

    target = build_model(args.shape)
    draft = build_model(args.draft)
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    opts = dict(max_num_seqs=128, max_model_len=args.prompt_len + args.max_new_tokens + 64)
    opts.setdefault("num_speculative_tokens", 5)
    opts.update(engine_options(args))
    engine = hf_paged.Engine(target, draft_model=draft, **opts)
    policy = engine.runner.spec.policy
    k_max = policy.max_k
    print(f"target {args.shape}, draft {args.draft}, batch {args.batch}, alpha {args.alpha}")
    print(f"engine options: {opts}; start-up {engine.startup_stats.get('total_s', 0):.1f} s")

    policy.max_k = 0
    run(engine, prompts, 16, "warm-off")
    engine.reset_prefix_cache()
    secs, steps = run(engine, prompts, args.max_new_tokens, "off")
    off = args.batch * args.max_new_tokens / secs
    print(f"no speculation: {off:,.1f} tok/s, {secs / steps * 1e3:.2f} ms/step over {steps} steps")

    policy.max_k = k_max
    spec = engine.runner.spec
    control = ControlledAcceptance(args.alpha, 0, spec.draft)
    with control:
        run(engine, prompts, 32, "warm-on")
        engine.reset_prefix_cache()
        policy.buckets.clear()
        clock = PhaseClock()
        runner = engine.runner
        clock.wrap(engine.scheduler, "schedule", "schedule")
        clock.wrap(runner, "execute", "runner.execute (all)")
        clock.wrap(runner, "_run_forward", "target forward (to logits)")
        clock.wrap(verify_step, "verify", "rejection sampler")
        clock.wrap(spec, "propose", "draft propose (all)")
        clock.wrap(spec.draft.runner, "execute", "draft execute (queue)")
        clock.wrap(spec.draft.runner, "finish_async", "draft finish_async (wait+read)")
        clock.wrap(model_runner, "finish_decode_run", "draft finish_decode_run (wait+read)")
        clock.wrap(model_runner, "verify_step", "verify_step (all)")
        before = engine.stats()
        secs, steps = run(engine, prompts, args.max_new_tokens, "on")
        after = engine.stats()
        clock.undo()
    on = args.batch * args.max_new_tokens / secs
    vsteps = after["spec_num_verify_steps"] - before["spec_num_verify_steps"]
    proposed = after["spec_num_proposed"] - before["spec_num_proposed"]
    accepted = after["spec_num_accepted"] - before["spec_num_accepted"]
    print(
        f"speculation: {on:,.1f} tok/s ({on / off:.2f}x), {steps} steps of which {vsteps} "
        f"verified; acceptance {accepted / max(proposed, 1):.2f}, "
        f"{proposed / max(vsteps, 1) / args.batch:.1f} proposals a request per verify step; "
        f"{secs / steps * 1e3:.2f} ms/step"
    )
    print("host phases over the run (ms per step; nested phases are inside their parent):")
    for name, s in sorted(clock.seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {name:34s} {s / steps * 1e3:7.3f}")

    # the profiler window: GPU busy and kernels per step
    from torch.profiler import ProfilerActivity, profile

    with control:
        engine.reset_prefix_cache()
        policy.buckets.clear()
        from hf_paged import SamplingParams

        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=f"prof-{i}")
        for _ in range(10):  # past the prefill and the policy's first measurements
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.window):
                engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        # the host's frames in a window of their own: under torch.profiler, cProfile saw a
        # fraction of the calls (both hook the interpreter's profiling)
        host = cProfile.Profile() if args.cprofile else None
        if host is not None:
            host.enable()
            for _ in range(args.window):
                engine.step()
            torch.cuda.synchronize()
            host.disable()
        while engine.has_unfinished_requests():
            engine.step()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = gpu_busy_us(events)
    n = args.window
    print(
        f"\nwindow of {n} steps: {wall / n * 1e3:.2f} ms/step wall (profiler on), GPU busy "
        f"{busy / 1e3 / n:.2f} ms/step ({busy / 1e6 / wall:.0%}), {len(events) / n:.0f} "
        "kernels/step"
    )
    print(kernel_rows(events, n, top=30))
    print(timeline(events, steps=2))
    if host is not None:
        buf = io.StringIO()
        stats = pstats.Stats(host, stream=buf)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        print(buf.getvalue())
    engine.shutdown()


if __name__ == "__main__":
    main()
