"""`run.py sampling`: sampling against greedy through the engine, and the sampler alone.

Engine part, per model shape (random weights, one Engine a shape, all requests submitted at
once, EOS ignored, prefix cache reset before each run): W1 (256 requests, prompts 64-512 random
tokens, 256 new tokens) and R128 (128 requests, prompts 64-512, 128 new tokens), each in three
modes: greedy; temperature 0.7, top-p 0.9, top-k 50; the same plus repetition penalty 1.1. Each
sampling mode is printed as a ratio to greedy against the targets (>= 0.90 without the penalty,
>= 0.80 with it). Every mode is warmed up at its own options over the same prompts (8 new
tokens each) before the clock. --profile-steps N
then runs N decode steps of each under torch.profiler and prints its ops by host and device time.

Kernel part: the sampler's draw alone on [rows, vocab] bfloat16 logits (CUDA events, median of
repeats): what the sampler runs (temperature 0.7, top-k 50, top-p 0.9 through
kernels/sampling_topk.py; top-p 0.9 alone and min-p 0.05 alone through kernels/sampling.py, and
the first case through kernels/sampling.py too, "search") against the sort path it replaced
(temperature, sort-based top-k and top-p from hf_paged.sample.logits_processing, softmax,
exponential race) and torch.multinomial on the softmax (no top-k/top-p at all: a floor for any
draw).
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from .errors import EvalError

MODES = {
    "greedy": dict(temperature=0.0),
    "sample": dict(temperature=0.7, top_p=0.9, top_k=50),
    "sample+rep": dict(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1),
}
TARGETS = {"sample": 0.90, "sample+rep": 0.80}
WORKLOADS = {  # name: (requests, new tokens); prompts 64-512 random tokens
    "w1": (256, 256),
    "r128": (128, 128),
}


def add_parser(sub, common) -> None:
    p = sub.add_parser("sampling", help="sampling vs greedy tok/s per shape; the sampler alone")
    common(p, "auto", "auto")
    p.add_argument("--shapes", default="tinyllama-1.1b,qwen3-1.7b,gemma-2-2b", help="comma list")
    p.add_argument("--workloads", default="w1,r128", help="comma list of w1, r128")
    p.add_argument("--no-engine", action="store_true", help="only the sampler alone")
    p.add_argument("--no-kernel", action="store_true", help="only the engine runs")
    p.add_argument("--kernel-rows", type=int, default=128)
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each timed run, N decode steps of it under torch.profiler: op tables",
    )
    p.add_argument("--kernel-vocabs", default="151936,256000", help="comma list")
    p.set_defaults(run=cmd_sampling)


def cmd_sampling(args, save) -> int:
    if not torch.cuda.is_available() or args.device == "cpu":
        raise EvalError("sampling: a CUDA GPU is needed (the numbers are GPU rates)")
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            raise EvalError(f"sampling: unknown workload {w!r}: use {', '.join(WORKLOADS)}")
    payload, tables = {"argv": sys.argv, "engine": [], "kernel": []}, []
    if not args.no_kernel:
        rows = kernel_bench(args.kernel_rows, [int(v) for v in args.kernel_vocabs.split(",")])
        payload["kernel"] = rows
        tables.append(_kernel_table(rows, args.kernel_rows))
        print(tables[-1] + "\n", flush=True)
    if not args.no_engine:
        for shape in args.shapes.split(","):
            result = engine_bench(shape, workloads, args.seed, profile_steps=args.profile_steps)
            payload["engine"].append(result)
            tables.append(_engine_table(result))
            print(tables[-1] + "\n", flush=True)
    path = save(
        args.out, f"sampling-{time.strftime('%Y%m%d-%H%M%S')}", payload, "\n\n".join(tables)
    )
    print(f"results: {path}")
    return 0


# -- engine ----------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(engine, prompts, params_list, tag) -> float:
    """All requests at once; output tokens / second."""
    device = engine.runner.device
    _sync(device)
    t0 = time.perf_counter()
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(prompt, params, request_id=f"{tag}-{i}")
    out_tokens = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out_tokens += len(o.output_token_ids)
    _sync(device)
    return out_tokens / (time.perf_counter() - t0)


def engine_bench(
    shape: str, workloads: list[str], seed: int, device: str = "cuda", profile_steps: int = 0
) -> dict:
    import hf_paged
    from hf_paged import SamplingParams

    from .models import describe, load_model

    loaded = load_model(shape, "bfloat16" if device == "cuda" else "float32", device)
    vocab = loaded.model.config.get_text_config().vocab_size
    rng = random.Random(seed)
    t0 = time.perf_counter()
    engine = hf_paged.Engine(loaded.model, max_num_seqs=256)
    startup = time.perf_counter() - t0
    result = {"shape": shape, "model": describe(loaded), "startup_s": startup, "runs": []}
    for wname in workloads:
        num, new = WORKLOADS[wname]
        prompts = [
            [rng.randrange(16, vocab) for _ in range(rng.randint(64, 512))] for _ in range(num)
        ]
        for mode, opts in MODES.items():
            params = SamplingParams(max_tokens=new, ignore_eos=True, **opts)
            # warm-up at these options over the timed run's own prompts (their prefill chunk
            # shapes, its batch sizes, the options' kernel variants and graphs), then the timed
            # run: a 16-prompt warm-up left one-time costs inside the first timed run of a
            # workload (a greedy row slower than its sampled rows, 0.66x, Qwen3-1.7B r128)
            warm = SamplingParams(max_tokens=8, ignore_eos=True, **opts)
            _timed(engine, prompts, [warm] * num, f"warm-{wname}-{mode}")
            engine.reset_prefix_cache()
            tok_s = _timed(engine, prompts, [params] * num, f"{wname}-{mode}")
            engine.reset_prefix_cache()
            result["runs"].append({"workload": wname, "mode": mode, "tok_s": tok_s})
            if profile_steps:
                _profile(engine, prompts, params, profile_steps, f"{shape} {wname} {mode}")
                engine.reset_prefix_cache()
            print(f"  {shape} {wname} {mode}: {tok_s:,.0f} tok/s", flush=True)
    engine.check_invariants()
    engine.shutdown()
    del engine, loaded
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def _profile(engine, prompts, params, steps: int, title: str) -> None:
    """Where a decode step's time goes: every request of the workload decoding, `steps` steps
    under torch.profiler; prints the ops by host time (launches, syncs, copies: what keeps the
    host from running ahead) and by device time."""
    from torch.profiler import ProfilerActivity, profile

    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"prof-{title}-{i}")
    while engine.scheduler.waiting:  # past the prompts, then a few steps more
        engine.step()
    for _ in range(5):
        engine.step()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        _sync(engine.runner.device)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    table = prof.key_averages()
    print(f"## profile {title}: {steps} decode steps, {ms:.2f} ms a step (under the profiler)")
    print(table.table(sort_by="self_cpu_time_total", row_limit=25))
    print(table.table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
    while engine.has_unfinished_requests():
        engine.step()


def _engine_table(result: dict) -> str:
    lines = [
        f"## sampling vs greedy: {result['shape']}",
        "",
        f"- model: {result['model']}; engine start-up {result['startup_s']:.1f} s",
        "- modes: sample = temperature 0.7, top-p 0.9, top-k 50; sample+rep = that plus "
        "repetition penalty 1.1",
        "",
        "| workload | mode | out tok/s | / greedy | target |",
        "|---|---|---|---|---|",
    ]
    greedy = {r["workload"]: r["tok_s"] for r in result["runs"] if r["mode"] == "greedy"}
    for r in result["runs"]:
        ratio = r["tok_s"] / greedy[r["workload"]]
        target = TARGETS.get(r["mode"])
        verdict = (
            "" if target is None else f">= {target:.2f}: {'met' if ratio >= target else 'MISSED'}"
        )
        lines.append(
            f"| {r['workload']} | {r['mode']} | {r['tok_s']:,.0f} | {ratio:.3f} | {verdict} |"
        )
    return "\n".join(lines)


# -- the sampler alone -----------------------------------------------------------------------------


def _cuda_ms(fn, repeats: int = 20, inner: int = 5) -> float:
    fn()  # compile / warm
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def _sort_path(logits, temp, top_k, top_p):
    """The draw before kernels/sampling.py: float32 copy, temperature, sort-based top-k and
    top-p, softmax, exponential race, argmax."""
    from hf_paged.sample.logits_processing import apply_top_k, apply_top_p

    scores = logits.float() / temp[:, None]
    scores = apply_top_p(apply_top_k(scores, top_k), top_p)
    probs = scores.softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def kernel_bench(rows: int, vocabs: list[int]) -> list[dict]:
    from hf_paged.kernels.sampling import sample_rows
    from hf_paged.kernels.sampling_topk import sample_rows_topk

    dev = torch.device("cuda")
    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    for vocab in vocabs:
        # logits with a real model's spread (a few units) rather than random weights' flat rows
        logits = (torch.randn(rows, vocab, device=dev, generator=g) * 3).bfloat16()
        full = lambda v, dt=torch.float32: torch.full((rows,), v, dtype=dt, device=dev)  # noqa: E731
        zero_k = full(0, torch.int32)
        cases = {
            "ours t0.7 k50 p0.9": lambda: sample_rows_topk(
                logits,
                full(0.7),
                full(50, torch.int32),
                full(0.9),
                full(0.0),
                torch.rand(rows, device=dev),
                50,
            ),
            "search t0.7 k50 p0.9": lambda: sample_rows(
                logits,
                full(0.7),
                full(50, torch.int32),
                full(0.9),
                full(0.0),
                torch.rand(rows, device=dev),
            ),
            "ours p0.9": lambda: sample_rows(
                logits, full(1.0), zero_k, full(0.9), full(0.0), torch.rand(rows, device=dev)
            ),
            "ours min-p 0.05": lambda: sample_rows(
                logits, full(1.0), zero_k, full(1.0), full(0.05), torch.rand(rows, device=dev)
            ),
            "sort path t0.7 k50 p0.9": lambda: _sort_path(
                logits, full(0.7), full(50, torch.int64), full(0.9)
            ),
            "multinomial(softmax)": lambda: torch.multinomial(
                (logits.float() / 0.7).softmax(dim=-1), 1
            ),
            "argmax (greedy)": lambda: logits.argmax(dim=-1),
        }
        for name, fn in cases.items():
            out.append({"vocab": vocab, "case": name, "ms": _cuda_ms(fn)})
            print(f"  vocab {vocab} {name}: {out[-1]['ms'] * 1000:.1f} us", flush=True)
    return out


def _kernel_table(rows: list[dict], num_rows: int) -> str:
    lines = [
        f"## the sampler alone: {num_rows} rows of bfloat16 logits (randn * 3)",
        "",
        "| vocab | case | us | / sort path |",
        "|---|---|---|---|",
    ]
    for r in rows:
        sort = next(x for x in rows if x["vocab"] == r["vocab"] and x["case"].startswith("sort"))
        lines.append(
            f"| {r['vocab']} | {r['case']} | {r['ms'] * 1000:.1f} | {r['ms'] / sort['ms']:.3f} |"
        )
    return "\n".join(lines)
