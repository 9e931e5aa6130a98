"""Multi-LoRA throughput: the base model vs 1 adapter vs N adapters spread over the requests.

    python evals/profiling/lora_bench.py [--shape llama-3-8b] [--adapters 8] [--rank 16]
        [--workload synthetic|FILE.json] [--requests 256] [--new-tokens 256] [--hf-batch 64]
        [--hf-requests 128] [--passes 1] [--rounds 1] [--profile] [--device cuda]
        [--dtype bfloat16]
        [engine options: --compile 0 --max-loras 8 ...]

A model of the shape with random weights; W1's prompts (evals/workloads.py, the first
--requests), --new-tokens output tokens each, EOS ignored; or a workload file saved by
`run.py export-workload` (e.g. ShareGPT's real prompt and output lengths), each request its own
output length. First the base model on the engine
with its defaults (and the engine options given); then the same model as a PeftModel with
--adapters adapters of rank --rank on all seven projections (q/k/v/o, gate/up/down; lora_B drawn
at random so they cost what real ones do), all requests on one adapter, then request i on
adapter i % N. Then batch 1 (one 128-token prompt) without and with an adapter. Each run is
preceded by a warm-up on 8 prompts (Triton JIT, compile, graphs). With --hf-batch B > 0, the
same requests through transformers + peft generate in static batches of B (left padding, EOS
off, evals/backends.py's settings): one adapter (peft's active adapter), then the spread as
peft's adapter_names, over the first --hf-requests requests (tok/s of full static batches, so
a subset measures the same rate in less time). Prints output tokens/s, each row as it is
measured, the ratios to the base model, and the engine's ratio to transformers + peft (W1
only), and batch 1's bandwidth bound (linear weight bytes / 4.2 TB/s). The targets: N
adapters >= 85% of base, 1 adapter >= 90%, batch 1 with an adapter >= 85% of batch 1 without.

--rounds N (> 1): instead, the base and the adapters' engines side by side, their batched runs
alternated N times after one untimed round (interleaved() says why); no batch-1 or
transformers runs. Every timed pass starts with an empty prefix cache.

--profile: after each batched engine run, one more pass under torch.profiler: wall and GPU-busy
milliseconds, prefill-carrying and decode-only step counts, the kernels by time.

--device cpu --dtype float32 --shape smollm2-135m runs the same on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_setup import (
    PEAK_BW,
    PROJECTIONS,
    SHAPES,
    add_adapters,
    add_engine_options,
    build_model,
    engine_options,
    gpu_busy_us,
    kernel_rows,
    roofline,
    workloads,
)

PASSES = 1  # timed passes of each engine run (--passes); the last one is reported
PROFILE = False  # --profile: one more pass of each batched run under torch.profiler


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(eng, prompts, names, lengths: list[int], device: str) -> float:
    """Output tokens/s of one generate call over these prompts (names[i]: request i's adapter,
    lengths[i]: its output tokens)."""
    from hf_paged import SamplingParams

    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, adapter=name)
        for name, n in zip(names, lengths)
    ]
    warm = min(8, len(prompts))
    eng.generate(prompts[:warm], params[:warm])  # JIT, compile, graphs: not timed
    rates = []
    for _ in range(PASSES):
        # every pass prefills its prompts: blocks cached by an earlier pass or round (the same
        # prompts) would skip the prefill and time another workload (H200, side by side
        # without this: 1 adapter 17,541 -> 54,829 tok/s, the base 66,807 -> 92,506)
        eng.reset_prefix_cache()
        _sync(device)
        t = time.perf_counter()
        outs = eng.generate(prompts, params)
        _sync(device)
        rates.append(sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t))
    if len(rates) > 1:
        print("  passes: " + ", ".join(f"{r:,.0f}" for r in rates) + " tok/s", flush=True)
    if PROFILE and len(prompts) > 1:
        profiled_pass(eng, prompts, params)
    return rates[-1]


def profiled_pass(eng, prompts, params) -> None:
    """One more pass (prefix cache emptied) under torch.profiler: its wall time, the GPU's busy
    time (union of kernel intervals) and its kernels by total time, in ms for the whole pass,
    steps split into prefill-carrying and decode-only by the scheduler's token count."""
    from torch.profiler import ProfilerActivity, profile

    marks: list[tuple[float, str]] = []  # (when, kind) of each step scheduled
    original = eng.scheduler.schedule

    def counted(*a, **k):
        out = original(*a, **k)
        n = out.total_num_scheduled_tokens
        if n:
            marks.append((time.perf_counter(), "decode" if n == len(out) else "mixed"))
        return out

    graphs = eng.runner.graphs
    replays = dict(graphs.replays) if graphs is not None else {}
    eng.scheduler.schedule = counted
    eng.reset_prefix_cache()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        eng.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    eng.scheduler.schedule = original
    # a step's wall: from its schedule() to the next one's (the last one: to the pass's end)
    by_kind = {"mixed": [0, 0.0], "decode": [0, 0.0]}
    for (when, kind), (after, _) in zip(marks, [*marks[1:], (t + wall, "")]):
        by_kind[kind][0] += 1
        by_kind[kind][1] += after - when
    steps = ", ".join(f"{k} {n} steps {ms * 1e3:,.1f} ms" for k, (n, ms) in by_kind.items())
    if graphs is not None:
        steps += f"; graph replays { {k: graphs.replays[k] - replays[k] for k in replays} }"
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(
        f"  profiled pass: {wall * 1e3:,.1f} ms wall, GPU busy {gpu_busy_us(kernels) / 1e3:,.1f} "
        f"ms; {steps} (us per pass below, / 1000 = ms)" + kernel_rows(kernels, 1, top=18),
        flush=True,
    )


def run_hf(model, prompts, names, new_tokens: int, batch: int, device: str) -> float:
    """Output tokens/s of transformers + peft generate in static batches of new_tokens each
    (names: peft's adapter_names per row, or None: the active adapter)."""
    from hf_paged_evals.backends import _left_pad, _pad_id, hf_generate_config

    dev = torch.device(device)
    config = hf_generate_config(model, new_tokens)
    pad = _pad_id(model)
    with torch.inference_mode():  # warm-up outside the clock
        ids, mask = _left_pad([[17] * 16], pad, dev)
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    _sync(device)
    t = time.perf_counter()
    made = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        ids, mask = _left_pad(chunk, pad, dev)
        extra = {} if names is None else {"adapter_names": names[start : start + batch]}
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, **extra
            )
        made += (out.shape[1] - ids.shape[1]) * len(chunk)
    _sync(device)
    return made / (time.perf_counter() - t)


def main() -> None:
    from hf_paged import Engine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tinyllama-1.1b", choices=SHAPES)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--workload", default="synthetic", help="synthetic (W1) or a .json file")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256, help="W1's output tokens")
    parser.add_argument("--hf-batch", type=int, default=64, help="0: no transformers + peft run")
    parser.add_argument(
        "--passes", type=int, default=1, help="timed passes per engine run (the last reported)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="> 1: the base and the adapters' engines both kept, their runs alternated this "
        "many rounds (medians reported; each engine gets --memory-share of the GPU's memory)",
    )  # fmt: skip
    parser.add_argument("--memory-share", type=float, default=0.4, help="with --rounds > 1")
    parser.add_argument(
        "--profile", action="store_true", help="one more pass of each batched run, profiled"
    )
    parser.add_argument("--hf-requests", type=int, default=128, help="requests run by peft")
    parser.add_argument(
        "--layers", type=int, default=None, help="fewer decoder layers than the shape's (smoke)"
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add_engine_options(parser)
    args = parser.parse_args()
    opts = engine_options(args)
    global PASSES, PROFILE
    PASSES = max(1, args.passes)
    PROFILE = args.profile and args.device == "cuda"
    model = build_model(args.shape, getattr(torch, args.dtype), args.device, args.layers)
    # batch 1 reads the linear layers' weights once a token (the embedding table: one row)
    weight_bytes = roofline.model_costs(model).weight_bytes
    vocab = model.config.vocab_size
    if args.workload == "synthetic":
        wl = workloads.synthetic(vocab, seed=0).with_max_new_tokens(args.new_tokens)
    else:
        wl = workloads.load_workload_file(args.workload, vocab)
    wl = wl.limited(args.requests)
    prompts = [r.prompt_token_ids for r in wl.requests]
    lengths = [r.max_new_tokens for r in wl.requests]
    one = [torch.randint(3, vocab, (128,), generator=torch.Generator().manual_seed(1)).tolist()]
    n, new = len(prompts), args.new_tokens
    print(
        f"{args.shape}{f' ({args.layers} layers)' if args.layers else ''} {args.dtype} "
        f"{args.device} ({describe_device(args.device)}): "
        f"{wl.summary()}; rank {args.rank} on {len(PROJECTIONS)} projections, options {opts}",
        flush=True,
    )
    print("| run | output tok/s | / base |\n| --- | ---: | ---: |", flush=True)

    def row(name: str, tps: float, ref: float) -> None:
        print(f"| {name} | {tps:,.1f} | {tps / ref:.1%} |", flush=True)

    if args.rounds > 1:
        interleaved(args, opts, prompts, lengths)
        return
    eng = Engine(model, **opts)
    base = run(eng, prompts, [None] * n, lengths, args.device)
    row("base model", base, base)
    base1 = run(eng, one, [None], [2 * new], args.device)
    eng.shutdown()

    model = add_adapters(model, args.adapters, args.rank)
    eng = Engine(model, **{"max_loras": max(8, args.adapters), **opts})
    single = run(eng, prompts, ["a0"] * n, lengths, args.device)
    row("1 adapter", single, base)
    spread = [f"a{i % args.adapters}" for i in range(n)]
    many = run(eng, prompts, spread, lengths, args.device)
    row(f"{args.adapters} adapters, uniform", many, base)
    print(
        f"batch 1 bound (linear weights / 4.2 TB/s): {PEAK_BW / weight_bytes:,.1f} tok/s",
        flush=True,
    )
    row("batch 1, base", base1, base1)
    row("batch 1, 1 adapter", run(eng, one, ["a0"], [2 * new], args.device), base1)
    eng.shutdown()
    if args.hf_batch > 0 and args.workload == "synthetic":
        # static batches of W1's prompts at --new-tokens each, against the engine's W1-shaped run
        hf_prompts = prompts[: args.hf_requests]
        print(
            f"\ntransformers + peft generate, static batches of {args.hf_batch}, "
            f"{len(hf_prompts)} requests x {new} tokens\n"
            "| run | hf_paged tok/s | transformers + peft tok/s | ratio |\n"
            "| --- | ---: | ---: | ---: |",
            flush=True,
        )
        model.set_adapter("a0")
        theirs = run_hf(model, hf_prompts, None, new, args.hf_batch, args.device)
        print(f"| 1 adapter | {single:,.0f} | {theirs:,.0f} | {single / theirs:.2f}x |", flush=True)
        mixed = spread[: len(hf_prompts)]
        theirs = run_hf(model, hf_prompts, mixed, new, args.hf_batch, args.device)
        label = f"{args.adapters} adapters"
        print(f"| {label} | {many:,.0f} | {theirs:,.0f} | {many / theirs:.2f}x |", flush=True)


def interleaved(args, opts: dict, prompts, lengths) -> None:
    """The base model and a PeftModel of the same shape (a second copy with the same random
    weights, so that peft's layers never reach the base engine's model) on engines alive at
    once, their runs alternated: base, 1 adapter, N adapters, --rounds times. The H200 host's
    speed drifts between calls by ~10% (evals/RESULTS.md), so a ratio is only read off runs
    taken side by side: each round's ratios and their medians."""
    import statistics

    from hf_paged import Engine

    n = len(prompts)
    dtype = getattr(torch, args.dtype)
    # gpu_memory_utilization counts the whole process's memory: the second engine's share is
    # on top of the first's
    first = {**opts, "gpu_memory_utilization": args.memory_share}
    base_eng = Engine(build_model(args.shape, dtype, args.device, args.layers), **first)
    peft = add_adapters(
        build_model(args.shape, dtype, args.device, args.layers), args.adapters, args.rank
    )
    second = {**first, "gpu_memory_utilization": min(0.9, 2 * args.memory_share)}
    lora_eng = Engine(peft, **{"max_loras": max(8, args.adapters), **second})
    spread = [f"a{i % args.adapters}" for i in range(n)]
    runs = {
        "base model": (base_eng, [None] * n),
        "1 adapter": (lora_eng, ["a0"] * n),
        f"{args.adapters} adapters, uniform": (lora_eng, spread),
    }
    for eng, names in runs.values():  # a whole untimed round first: its first full-width
        run(eng, prompts, names, lengths, args.device)  # batches' one-time costs stay out
    rates: dict[str, list[float]] = {name: [] for name in runs}
    print("| round | " + " | ".join(runs) + " | ratios |\n|" + " --- |" * (len(runs) + 2))
    for r in range(args.rounds):
        for name, (eng, names) in runs.items():
            rates[name].append(run(eng, prompts, names, lengths, args.device))
        base, *others = (rates[name][-1] for name in runs)
        cells = " | ".join(f"{rates[name][-1]:,.0f}" for name in runs)
        ratios = " / ".join(f"{o / base:.1%}" for o in others)
        print(f"| {r + 1} | {cells} | {ratios} |", flush=True)
    base_rates = rates["base model"]
    for name in list(runs)[1:]:
        each = [o / b for o, b in zip(rates[name], base_rates)]
        print(
            f"{name}: median {statistics.median(rates[name]):,.0f} tok/s, median of the rounds' "
            f"ratios to the base {statistics.median(each):.1%} (range {min(each):.1%}-"
            f"{max(each):.1%}); base median {statistics.median(base_rates):,.0f}",
            flush=True,
        )
    base_eng.shutdown()
    lora_eng.shutdown()


def describe_device(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "CPU"


if __name__ == "__main__":
    main()
