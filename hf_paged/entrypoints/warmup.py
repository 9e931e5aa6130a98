"""`hf-paged warmup MODEL_OR_PATH [engine options]` (or `python -m hf_paged.entrypoints.warmup`):
load the model as `hf-paged serve` does, build an Engine once and run one short greedy request,
so that torch.compile's and Triton's on-disk caches hold what the next process with the same
model, options, GPU and versions compiles (docs/startup.md), and print where the start-up time
went. Pass the same engine options the later process will use: the caches are keyed by shapes."""

from __future__ import annotations

import argparse
import sys
import time

from hf_paged import envs
from hf_paged.entrypoints.serve import (
    add_engine_arguments,
    add_model_arguments,
    load,
    model_engine_options,
)
from hf_paged.worker.startup_times import PHASES

# the short request: first-use compiles a request meets after start-up (sampling, prefill tiles)
PROMPT_TOKENS, NEW_TOKENS = 64, 8


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-paged warmup", description=__doc__)
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help="the compile caches' folder (default: $HF_PAGED_COMPILE_CACHE, else torch's and "
        "Triton's own); TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR, when set, win",
    )
    p.add_argument("--no-request", action="store_true", help="start-up only, no request")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        options = model_engine_options(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    envs.use_compile_cache(args.compile_cache)  # before anything compiles (load imports torch)
    t0 = time.perf_counter()
    try:
        model, tokenizer = load(args)
    except (OSError, ValueError) as exc:
        print(f"error: cannot load {args.model}: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    from hf_paged.engine.engine import Engine

    try:
        engine = Engine(model, tokenizer, **options)
    except ValueError as exc:  # what the engine refuses, after loading
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        request = None if args.no_request else _first_request(engine)
    finally:
        engine.shutdown()
    print(report(args.model, load_s, engine.startup_stats, request))
    return 0


def _first_request(engine) -> tuple[float, int]:
    """Seconds of one short greedy request, and its prompt's length."""
    from hf_paged.sampling_params import SamplingParams

    vocab = engine.vocab_size
    length = max(1, min(PROMPT_TOKENS, engine.config.max_model_len - NEW_TOKENS))
    prompt = [(7 * i) % (vocab // 2) + vocab // 2 for i in range(length)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate([prompt], params)
    return time.perf_counter() - t0, length


def report(model: str, load_s: float, stats: dict, request: tuple[float, int] | None) -> str:
    lines = [f"hf-paged warmup {model}", f"  load model          {load_s:8.2f} s"]
    for name in PHASES:
        lines.append(f"  {name:<20}{stats[f'{name}_s']:8.2f} s")
    lines.append(f"  {'engine start-up':<20}{stats['total_s']:8.2f} s")
    lines.append(
        f"  CUDA graphs: {stats['decode_graphs']} decode + {stats['mixed_graphs']} mixed-step"
    )
    if request is not None:
        seconds, length = request
        lines.append(f"  first request ({length}-token prompt, {NEW_TOKENS} new): {seconds:.2f} s")
    for name in envs.COMPILE_CACHE_DIRS:
        where = getattr(envs, name)
        lines.append(f"  {name}: {where if where is not None else 'the library default'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
