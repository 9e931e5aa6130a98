"""`run.py startup`: an Engine's start-up with cold and with warm compile caches, and the first
request's time to first token against a warm engine's.

Two fresh processes in a row, each: load the model (--model as elsewhere: a shape with random
weights, a folder, ...), build hf_paged.Engine (its startup_stats: seconds per phase), run the
first request (a --prompt-len-token random prompt, one new token, greedy), then two more, then
three fresh prompts of that length (no prefix-cache hit) whose median time to first token is the
warm engine's. The first process starts on an empty compile-cache folder (HF_PAGED_COMPILE_CACHE;
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR are left out of its environment so that the folder
is used), the second on what the first left there. Goals (the start-up issue): warm start-up
<= 10 s, cold <= 25 s, the first request's TTFT within 2x of the warm engine's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .errors import EvalError

GOAL_WARM_S, GOAL_COLD_S, GOAL_TTFT_RATIO = 10.0, 25.0, 2.0
RESULT = "STARTUP-RESULT "  # the line a child process reports on
RUNS = ("cold", "warm")


def add_parser(sub, common) -> None:
    from hf_paged.entrypoints.serve import add_engine_option

    p = sub.add_parser(
        "startup", help="Engine start-up by phase, cold and warm compile caches; first TTFT"
    )
    common(p, "auto", "auto")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of each request")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="the compile-cache folder, empty or absent (kept after); default a temporary one",
    )
    add_engine_option(p, "any Engine option, as `hf-paged serve` takes it; repeatable")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for each process")
    p.add_argument(
        "--cprofile", action="store_true",
        help="Python's profile of each Engine(...) (its main thread): the top functions with "
        "their callees, after the table",
    )  # fmt: skip
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measurement
    p.set_defaults(run=cmd_startup)


def cmd_startup(args, save) -> int:
    if args.child:
        print(RESULT + json.dumps(measure(args)), flush=True)
        return 0
    if args.prompt_len < 1:
        raise EvalError(f"--prompt-len must be positive, got {args.prompt_len}")
    keep = args.cache_dir is not None
    folder = Path(args.cache_dir) if keep else Path(tempfile.mkdtemp(prefix="hf-paged-cc-"))
    if folder.exists() and any(folder.iterdir()):
        raise EvalError(f"--cache-dir {folder}: not empty (the cold run needs an empty folder)")
    results = {}
    try:
        for run in RUNS:
            results[run] = _child(args, folder)
            results[run]["cache_files"] = _count_files(folder)
            print(f"({run} compile caches: {format_counts(results[run])})", flush=True)
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    table = format_table(results, str(folder) if keep else "a temporary folder")
    print(table)
    for run in RUNS:  # --cprofile
        if "profile" in results[run]:
            print(f"\n({run} compile caches)\n{results[run]['profile']}")
    payload = {"argv": sys.argv, "options": dict(args.engine_option), "runs": results}
    path = save(args.out, f"startup-{time.strftime('%Y%m%d-%H%M%S')}", payload, table)
    print(f"\nresults: {path}")
    return 0


def _child(args, folder: Path) -> dict:
    from hf_paged import envs

    cmd = [sys.executable, str(Path(__file__).resolve().parent / "run.py"), "startup", "--child"]
    cmd += ["--model", args.model, "--dtype", args.dtype, "--device", args.device]
    cmd += ["--prompt-len", str(args.prompt_len), "--seed", str(args.seed)]
    if args.cprofile:
        cmd += ["--cprofile"]
    for key, value in args.engine_option:
        cmd += ["--engine-option", f"{key}={value!r}"]
    # the caches of this measurement only: a user's own cache folders would make "cold" warm
    env = {k: v for k, v in os.environ.items() if k not in envs.COMPILE_CACHE_DIRS}
    env["HF_PAGED_COMPILE_CACHE"] = str(folder)
    try:
        out = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise EvalError(f"startup: a process ran past --timeout {args.timeout:.0f} s") from None
    for line in out.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    tail = (out.stderr or out.stdout).strip().splitlines()[-12:]
    raise EvalError("startup: the measuring process failed:\n" + "\n".join(tail))


def measure(args) -> dict:
    """In the child: load, build the Engine, time the first and warm requests."""
    import torch
    import triton

    import hf_paged
    from hf_paged import SamplingParams

    from .models import describe, load_model
    from .roofline import detect_hardware

    t0 = time.perf_counter()
    loaded = load_model(args.model, args.dtype, args.device)
    device = next(loaded.model.parameters()).device
    _sync(device)
    load_s = time.perf_counter() - t0
    profile = cProfile.Profile() if args.cprofile else None
    if profile is not None:
        profile.enable()
    engine = hf_paged.Engine(loaded.model, loaded.tokenizer, **dict(args.engine_option))
    if profile is not None:
        profile.disable()
    cfg = loaded.model.config.get_text_config()
    vocab = cfg.vocab_size
    length = min(args.prompt_len, engine.config.max_model_len - 1)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab // 2, vocab) for _ in range(length)] for _ in range(6)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(prompt) -> float:
        _sync(device)
        start = time.perf_counter()
        engine.generate([prompt], params)
        return time.perf_counter() - start

    first = ttft(prompts[0])
    for prompt in prompts[1:3]:
        ttft(prompt)
    warm = statistics.median(ttft(p) for p in prompts[3:])
    engine.shutdown()
    return {
        "model": describe(loaded),
        "hardware": detect_hardware(device).name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "prompt_len": length,
        "load_s": load_s,
        "startup": engine.startup_stats,
        "first_ttft_s": first,
        "warm_ttft_s": warm,
        **({} if profile is None else {"profile": _profile_table(profile)}),
    }


def _profile_table(profile) -> str:
    from .step_profile import table

    return table("Engine(...) profile", pstats.Stats(profile), 1, "start-up", by="cumulative")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _count_files(folder: Path) -> dict:
    from hf_paged import envs

    return {
        sub: sum(1 for p in (folder / sub).rglob("*") if p.is_file())
        for sub in envs.COMPILE_CACHE_DIRS.values()
    }


def format_counts(result: dict) -> str:
    return ", ".join(f"{sub} {n} files" for sub, n in result["cache_files"].items())


def format_table(results: dict, folder: str) -> str:
    from hf_paged.worker.startup_times import PHASES

    cold, warm = results["cold"], results["warm"]
    lines = [
        f"## start-up: {cold['model']}",
        "",
        f"- hardware: {cold['hardware']}; torch {cold['torch']}, triton {cold['triton']}",
        f"- compile caches in {folder}: empty before the cold process; after it "
        f"{format_counts(cold)}; after the warm one {format_counts(warm)}",
        "",
        "| seconds | cold caches | warm caches |",
        "|---|---|---|",
        f"| load model | {cold['load_s']:.2f} | {warm['load_s']:.2f} |",
    ]
    for name in PHASES:
        key = f"{name}_s"
        lines.append(f"| {name} | {cold['startup'][key]:.2f} | {warm['startup'][key]:.2f} |")
    lines.append(
        f"| **engine start-up** | **{cold['startup']['total_s']:.2f}** | "
        f"**{warm['startup']['total_s']:.2f}** |"
    )
    graphs = [
        f"{r['startup']['decode_graphs']} + {r['startup']['mixed_graphs']}" for r in (cold, warm)
    ]
    lines.append(f"| CUDA graphs (decode + mixed-step) | {graphs[0]} | {graphs[1]} |")
    n = cold["prompt_len"]
    lines.append(
        f"| first request's TTFT ({n}-token prompt) | {cold['first_ttft_s']:.3f} | "
        f"{warm['first_ttft_s']:.3f} |"
    )
    lines.append(
        f"| warm engine's TTFT (median of 3) | {cold['warm_ttft_s']:.3f} | "
        f"{warm['warm_ttft_s']:.3f} |"
    )
    ratio = {run: r["first_ttft_s"] / r["warm_ttft_s"] for run, r in results.items()}
    lines.append(f"| first / warm TTFT | {ratio['cold']:.2f}x | {ratio['warm']:.2f}x |")
    warm_s, cold_s = warm["startup"]["total_s"], cold["startup"]["total_s"]
    lines += [
        "",
        "- goals: warm start-up <= "
        f"{GOAL_WARM_S:.0f} s: {warm_s:.1f} s, {_verdict(warm_s <= GOAL_WARM_S)}; cold "
        f"start-up <= {GOAL_COLD_S:.0f} s: {cold_s:.1f} s, {_verdict(cold_s <= GOAL_COLD_S)}; "
        f"first request's TTFT within {GOAL_TTFT_RATIO:.0f}x of the warm engine's (warm "
        f"caches): {ratio['warm']:.2f}x, {_verdict(ratio['warm'] <= GOAL_TTFT_RATIO)}",
    ]
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"
