"""Engine-only W1 and batch-1 benchmark with a per-phase breakdown (no baselines: see run.py).

    python evals/profiling/engine_bench.py [--only batch1] [--shape llama-3-8b] [--kernels]
        [--batches 1,2,4,8] [--workload FILE] [--host-profile torch|cprofile]
        [engine options: --compile 0 --small-batch-rows 0 --max-graph-tokens 0 ...]

TinyLlama-1.1B shape (or --shape), bf16, random weights; W1 as evals/workloads.py defines it
(256 requests, prompts 64-512 random tokens, 256 output tokens, EOS ignored). Warm-up on 8
real-length prompts first (Triton JIT, graphs). Prints start-up by phase (compile, kernel
warm-up, graph capture, ...: engine.startup_stats), output tokens/s and the wall seconds
spent in schedule / execute / update over the run, then batch-1 decode tokens/s (one
128-token prompt, 512 new tokens, twice: the first run shows first-use compiles), then a
steady-state breakdown at 256 and at 1 running decodes: wall per step, GPU busy per step
(union of kernel intervals from torch.profiler) and kernels launched per step.
--kernels adds each kernel's launches and time; with --only batch1 also a timeline of the last
steps and the layer chain's critical path by kernel (each kernel's end minus the previous one's).

--workload FILE runs batch-1 and then the workload file through add_request/step, counting
decode-only and mixed steps, with a 40-step profile window from the middle of the run (GPU busy,
step() wall by kind of step; --kernels its kernel table; --host-profile where the host time
goes).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from bench_setup import (
    SHAPES,
    add_engine_options,
    build_model,
    engine_options,
    gpu_busy_us,
    kernel_rows,
    w1_prompts,
)

from hf_paged.worker.startup_times import format_startup


def main() -> None:
    from hf_paged import Engine, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tinyllama-1.1b", choices=SHAPES)
    parser.add_argument(
        "--only", choices=("all", "batch1"), default="all", help="batch1: skip W1 and 256 running"
    )
    parser.add_argument("--workload", help="a workload .json: run it, profile a window of steps")
    # host time in the workload's window: cprofile (Python frames), torch (torch.profiler CPU ops
    # next to the CUDA kernels: self CPU time per op, which cProfile's wrappers distort)
    parser.add_argument("--host-profile", choices=("cprofile", "torch"), default=None)
    parser.add_argument(
        "--kernels", action="store_true", help="per-kernel launches and time in the breakdowns"
    )
    parser.add_argument(
        "--batches", help="decode batch sizes of the steady-state breakdown (default 256,1)"
    )
    add_engine_options(parser)
    args = parser.parse_args()
    shape, only, workload, host_profile = args.shape, args.only, args.workload, args.host_profile
    table = args.kernels
    opts = engine_options(args)
    model = build_model(shape)
    print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, bf16")
    eng = Engine(model, **opts)
    print(
        f"{format_startup(eng.startup_stats)}; "
        f"{eng.kv.num_blocks} KV blocks, "
        f"compiled {eng.runner.forward.compiled}, "
        f"small-batch forward {eng.runner.forward.small_batch_status}",
        flush=True,
    )
    vocab = model.config.vocab_size
    prompts = w1_prompts(vocab, seed=0)
    warm = w1_prompts(vocab, seed=1)[:8]
    eng.generate(warm, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    if workload is not None:
        only = "batch1"  # batch-1 first (its first run shows first-use compiles), then the workload
    if only != "batch1":
        # the first run shows what start-up left to compile; fresh prompts (no prefix-cache hits)
        w1(eng, prompts, opts, "first")
        w1(eng, w1_prompts(vocab, seed=2), opts, "second")
    for run in ("first", "second"):  # the first pays for any first-use compile a lone prompt meets
        torch.cuda.synchronize()
        t = time.perf_counter()
        one = eng.generate(
            [prompts[0][:128]], SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
        )[0]
        torch.cuda.synchronize()
        rate = len(one.output_token_ids) / (time.perf_counter() - t)
        print(f"batch-1 decode ({run} run): {rate:,.0f} tok/s")
        # the same run without its prompt: tokens 2..512 over the time from the first token's
        # arrival on the host to the last's (the prefill and start-up are not decode; the
        # rate above includes them, ~2 ms of a ~0.37 s run)
        n, span = len(one.output_token_ids) - 1, one.finish_time - one.first_token_time
        print(
            f"batch-1 decode after the first token ({run} run): {n / span:,.0f} tok/s "
            f"({n} tokens, {1000 * span / n:.4f} ms a token)"
        )
    # --batches 1,4,8: the steady-state breakdown at these decode batch sizes (default 256,1)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    for batch in batches or ((256, 1) if only != "batch1" else (1,)):
        print(breakdown(eng, prompts, batch, kernel_table=table))
    if workload is not None:
        print(run_workload(eng, workload, kernel_table=table, host_profile=host_profile))


def w1(eng, prompts, opts, run: str) -> None:
    from hf_paged import SamplingParams

    spent = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    slow = []  # (seconds, tokens, seqs) of execute calls over 50 ms
    originals = (eng.scheduler.schedule, eng.runner.execute, eng.scheduler.update_from_output)

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            dt = time.perf_counter() - t
            spent[name] += dt
            if name == "execute" and dt > 0.05:
                sched = a[0]
                slow.append((round(dt, 3), sum(sched.num_scheduled_tokens), len(sched.requests)))
            return out

        return wrapper

    eng.scheduler.schedule = timed("schedule", originals[0])
    eng.runner.execute = timed("execute", originals[1])
    eng.scheduler.update_from_output = timed("update", originals[2])
    steps0 = eng.num_steps
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    eng.scheduler.schedule, eng.runner.execute, eng.scheduler.update_from_output = originals
    n_out = sum(len(o.output_token_ids) for o in outs)
    print(
        f"W1 {run} run {opts}: {n_out} tokens in {wall:.2f}s = {n_out / wall:,.0f} output tok/s "
        f"over {eng.num_steps - steps0} steps; seconds in "
        + ", ".join(f"{k} {v:.2f}" for k, v in spent.items())
        + f"; execute calls over 50 ms (s, tokens, seqs): {slow[:12]}"
    )


def run_workload(
    eng, path: str, window: int = 40, kernel_table: bool = False, host_profile: str | None = None
) -> str:
    """Run a workload .json (evals/workloads.py format) through add_request/step, count
    decode-only and mixed steps, and profile `window` steps from the middle of the run: GPU busy
    fraction, the window's step mix and (kernel_table) its kernels by time."""
    import json

    from torch.profiler import ProfilerActivity, profile

    from hf_paged import SamplingParams

    reqs = json.loads(Path(path).read_text())["requests"]
    for r in reqs:
        eng.add_request(
            r["prompt_token_ids"],
            SamplingParams(max_tokens=r["max_new_tokens"], temperature=0, ignore_eos=True),
        )
    kinds = {"decode": [0, 0], "mixed": [0, 0]}  # steps, tokens
    graphs = eng.runner.graphs
    replays0 = dict(graphs.replays) if graphs is not None else None
    original = eng.scheduler.schedule

    def counted(*a, **k):
        out = original(*a, **k)
        n = out.total_num_scheduled_tokens
        if n:
            kind = kinds["decode" if n == len(out) else "mixed"]
            kind[0] += 1
            kind[1] += n
        return out

    eng.scheduler.schedule = counted
    expected = sum(r["max_new_tokens"] for r in reqs) // 256 + 1  # steps at full concurrency
    start = max(expected // 2, 1)
    prof, window_mix, window_wall, steps = None, None, None, 0
    torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        if steps == start:
            torch.cuda.synchronize()
            window_mix = {k: list(v) for k, v in kinds.items()}
            cuda = torch.cuda.is_available()
            activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
            if host_profile == "torch" and cuda:
                activities.append(ProfilerActivity.CPU)
            prof = profile(activities=activities)
            prof.start()
            step_walls = {"decode": [], "mixed": []}
            if host_profile == "cprofile":
                host = cProfile.Profile()
                host.enable()
            tw = time.perf_counter()
        before = kinds["mixed"][0]
        t_step = time.perf_counter()
        eng.step()
        if prof is not None and window_wall is None:  # this call scheduled (and launched) one step
            kind = "mixed" if kinds["mixed"][0] > before else "decode"
            step_walls[kind].append(time.perf_counter() - t_step)
        steps += 1
        if prof is not None and steps == start + window:
            torch.cuda.synchronize()
            window_wall = time.perf_counter() - tw
            if host_profile == "cprofile":
                host.disable()
            prof.stop()
            window_mix = {k: [a - b for a, b in zip(kinds[k], window_mix[k])] for k in kinds}
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    eng.scheduler.schedule = original
    total_out = sum(r["max_new_tokens"] for r in reqs)
    text = (
        f"{path}: {len(reqs)} requests, {total_out} output tokens in {wall:.2f}s = "
        f"{total_out / wall:,.0f} output tok/s over {steps} steps; decode-only steps "
        f"{kinds['decode'][0]} ({kinds['decode'][1]} tokens), mixed steps {kinds['mixed'][0]} "
        f"({kinds['mixed'][1]} tokens)"
    )
    if graphs is not None:
        done = {k: graphs.replays[k] - replays0[k] for k in replays0}
        text += f"; graph replays: decode {done['decode']}, mixed {done['mixed']}"
    if window_wall is not None:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = gpu_busy_us(events)
        text += (
            f"\nwindow of {window} steps from step {start}: "
            f"{window_wall / window * 1e3:.2f} ms/step wall, "
            f"GPU busy {busy / 1e3 / window:.2f} ms/step "
            f"({busy / 1e6 / window_wall:.0%}), {len(events) / window:.0f} kernels/step; "
            f"decode-only {window_mix['decode']}, mixed {window_mix['mixed']} (steps, tokens)"
        )
        if kernel_table:
            text += kernel_rows(events, window)
        text += "\nstep() calls in the window, by the kind of step they launched: " + ", ".join(
            f"{k} {len(v)} x {sum(v) / len(v) * 1e3:.2f} ms" for k, v in step_walls.items() if v
        )
        if host_profile == "torch":
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            text += f"\nhost profile of the window (torch.profiler, self CPU time):\n{table}"
        if host_profile == "cprofile":
            buf = io.StringIO()
            stats = pstats.Stats(host, stream=buf)
            stats.sort_stats("cumulative").print_stats(40)
            stats.sort_stats("tottime").print_stats(25)
            text += "\nhost profile of the window (cProfile, cumulative, then own time):\n"
            text += buf.getvalue()
    return text


def breakdown(eng, prompts, batch: int, steps: int = 20, kernel_table: bool = False) -> str:
    """Decode-only steady state with `batch` running requests: profile `steps` engine steps.
    kernel_table: also list the kernels by launches per step (what to fuse next)."""
    from torch.profiler import ProfilerActivity, profile

    from hf_paged import SamplingParams

    params = SamplingParams(max_tokens=2 * steps + 40, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(prompts[i % len(prompts)][:200], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or (
        eng.scheduler.waiting
    ):
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):  # wall without the profiler's overhead
        eng.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = gpu_busy_us(kernels)
    while eng.has_unfinished_requests():
        eng.step()
    per = wall / steps * 1e3
    text = (
        f"steady state, {batch} running decodes: {per:.2f} ms/step wall, GPU busy "
        f"{busy / 1e3 / steps:.2f} ms/step ({busy / 1e3 / steps / per:.0%}), "
        f"{len(kernels) / steps:.0f} kernels/step"
    )
    if kernel_table:
        text += kernel_rows(kernels, steps)
        text += timeline(kernels)
    return text


# the small-batch forward's per-layer kernels: one "layer chain" line in the timeline
_CHAIN = ("_fused_gemv_kernel", "_norm_qkv_rope_kernel", "_rope_kv_kernel", "_decode_attention",
          "_reduce_splits", "_paged_attention_kernel")  # fmt: skip


def timeline(events, steps: int = 2) -> str:
    """The last `steps` steps' GPU work in start order, the layer kernels collapsed to one line:
    what runs outside the forward and the idle gaps between (us from the first line)."""
    evs = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    groups: list[list] = []  # [start, end, name, count, the chain's kernels]
    for a, b, name in evs:
        chain = name.startswith(_CHAIN)
        if chain and groups and groups[-1][2] == "layer chain":
            groups[-1][1] = max(groups[-1][1], b)
            groups[-1][3] += 1
            groups[-1][4].append((a, b, name))
        else:
            groups.append([a, b, "layer chain" if chain else name, 1, [(a, b, name)]])
    chains = [i for i, g in enumerate(groups) if g[2] == "layer chain"]
    if len(chains) < steps + 1:
        return ""
    window = groups[chains[-steps - 1] + 1 :]
    t0, prev = window[0][0], window[0][0]
    text = "\n  timeline of the last steps (us): start  duration  gap-before  what"
    for a, b, name, n, _ in window:
        what = f"{name} ({n} kernels)" if n > 1 else name[:80]
        text += f"\n  {a - t0:9.1f} {b - a:9.1f} {a - prev:9.1f}  {what}"
        prev = b
    # the last chain's final kernels one by one (the last layer's MLP, then lm_head): with PDL a
    # kernel starts before the one it waits for ends, so start and duration overlap
    last = groups[chains[-1]][4]
    text += "\n  the last layer chain's final kernels (us): start  duration  gap-before  what"
    for (a, b, name), (_, prev_end, _) in zip(last[-4:], last[-5:-1]):
        text += f"\n  {a - t0:9.1f} {b - a:9.1f} {a - prev_end:9.1f}  {name[:80]}"
    return text + critical_path([groups[i][4] for i in chains[-steps:]])


def _role(name: str, gemvs_since: int) -> str:
    # the small-batch forward's kernels in a layer: norm_qkv_rope, attention (+ split reduce),
    # then three fused_gemv launches (o, gate/up, down); one more after the last layer: lm_head
    if name.startswith("_fused_gemv"):
        return ("o-projection", "gate/up", "down", "lm_head")[min(gemvs_since, 3)]
    return name.lstrip("_").removesuffix("_kernel")[:40]


def critical_path(chains: list[list[tuple]]) -> str:
    """What each kernel adds to the chain's critical path: its end minus the previous kernel's
    end. With PDL a kernel starts early (its weight loads overlap the kernel before), so its
    start and duration say little; but every kernel waits for the one before it, so ends come in
    order and the step is the sum of these differences. Mean (min-max) over the layers."""
    per: dict[str, list[float]] = {}
    for chain in chains:
        gemvs = 0
        for (_, prev_end, _), (_, end, name) in zip(chain, chain[1:]):
            gemvs = gemvs + 1 if name.startswith("_fused_gemv") else 0
            per.setdefault(_role(name, gemvs - 1 if gemvs else 0), []).append(end - prev_end)
    text = "\n  critical path of the layer chain (us, end minus the previous kernel's end):"
    for role, d in per.items():
        text += (
            f"\n  {role:>24}: {sum(d) / len(d):6.2f} mean ({min(d):.2f}-{max(d):.2f}), "
            f"{sum(d) / len(chains):7.1f} a step"
        )
    return text


if __name__ == "__main__":
    main()
