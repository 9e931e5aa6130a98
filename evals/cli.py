"""The command line behind evals/run.py: accuracy, throughput, export-workload, report, plots,
coverage, serve-bench, serve-soak, spec, sampling, quant-accuracy, startup."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .errors import EvalError

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# A fresh CPU machine runs a shortened W1 so the default finishes in about a minute.
CPU_DEFAULT_LIMIT, CPU_DEFAULT_MAX_NEW_TOKENS = 8, 32


def _csv(values: list[str] | None, default: str) -> list[str]:
    items = []
    for v in [v for v in values or [] if v] or [default]:
        items += [x.strip() for x in v.split(",") if x.strip()]
    return items


def _common(p: argparse.ArgumentParser, model_default: str, dtype_default: str) -> None:
    p.add_argument(
        "--model",
        default=model_default,
        help="smollm2 | tinyllama-1.1b | llama-3-8b | qwen2.5-7b | smollm2-135m "
        "(shapes: random weights) | a local folder | a hub id; auto = smollm2 on "
        "CPU, tinyllama-1.1b shape on GPU",
    )
    p.add_argument("--dtype", default=dtype_default, help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--limit", type=int, default=None, help="number of requests / prompts")
    p.add_argument("--out", default=str(RESULTS_DIR), help="folder for JSON, markdown, PNG")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evals/run.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    acc = sub.add_parser("accuracy", help="engine vs transformers: parity, perplexity, MC")
    _common(acc, "smollm2", "float32")
    acc.add_argument(
        "--dataset",
        action="append",
        help="sharegpt (greedy parity) | shakespeare (perplexity) | "
        "date_understanding (multiple choice); comma list or repeated "
        "(default: all three)",
    )
    acc.add_argument(
        "--backend",
        action="append",
        help="engine under test: paged (hf_paged.Engine, default) and/or generate "
        "(hf_paged.patch + model.generate on a left-padded batch)",
    )
    acc.add_argument("--max-new-tokens", type=int, default=32, help="greedy parity length")
    acc.add_argument("--window", type=int, default=512, help="perplexity window in tokens")
    acc.add_argument("--text", default="hamlet_gut", help="Shakespeare text for perplexity")

    thr = sub.add_parser("throughput", help="workloads through paged / hf / hf-cb backends")
    _common(thr, "auto", "auto")
    thr.add_argument(
        "--dataset",
        action="append",
        help="synthetic (W1) | sharegpt | shared-prefix | batch1 | long-decode (4k prompts, "
        "512 out, 256 requests) | workload .json; "
        "comma list or repeated (default: synthetic)",
    )
    thr.add_argument(
        "--backend",
        action="append",
        help="paged | hf | hf-cb; comma list or repeated (default: all three)",
    )
    thr.add_argument(
        "--concurrency",
        default=None,
        help="comma list of max_num_seqs / static batch sizes to sweep (default: "
        "paged 256, hf 64, hf-cb transformers' own)",
    )
    thr.add_argument(
        "--max-new-tokens", type=int, default=None, help="override every request's output length"
    )
    thr.add_argument(
        "--full",
        action="store_true",
        help="on CPU, run the full workload instead of the shortened default",
    )
    thr.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=None,
        help="memory bandwidth for the roofline on hardware other than the H200",
    )
    thr.add_argument("--tflops", type=float, default=None, help="peak TFLOP/s for the roofline")
    thr.add_argument("--num-blocks", type=int, default=None, help="paged engine KV blocks")
    thr.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="paged engine token budget per step",
    )
    thr.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="paged engine torch.compile (auto: on for CUDA)",
    )
    thr.add_argument(
        "--compile-scope",
        choices=("model", "layers"),
        default=None,
        help="paged engine: compile each decoder layer (one shared graph; default) or the whole "
        "forward",
    )
    thr.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="paged engine: launch step n+1 before step n's tokens reach the host (default on)",
    )
    thr.add_argument(
        "--fuse-projections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="paged engine: q/k/v and gate/up projections as one matmul each (default on)",
    )
    thr.add_argument(
        "--small-batch-rows",
        type=int,
        choices=range(9),
        metavar="{0..8}",
        default=None,
        help="paged engine: steps of at most this many tokens run the fused small-batch forward "
        "(Llama/Mistral/Qwen2 on the Triton backend; default 2; 0 off)",
    )
    thr.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="paged engine: FP8 weights (docs/quantization.md)",
    )
    thr.add_argument(
        "--bnb",
        default=None,
        help="quantise the model with bitsandbytes as transformers loads it (every backend "
        "runs that model): nf4 | nf4-double | fp4 | int8",
    )
    thr.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="paged engine: auto | fp8_e4m3 | fp8_e5m2 | float16 | bfloat16 | float32",
    )
    thr.add_argument("--no-plots", action="store_true")

    exp = sub.add_parser(
        "export-workload", help="save a tokenized workload as JSON (for machines without PyPI)"
    )
    _common(exp, "smollm2", "float32")
    exp.add_argument("--dataset", default="sharegpt")
    exp.add_argument("--file", required=True, help="output .json path")

    rep = sub.add_parser(
        "report",
        help="one side-by-side table from throughput results of separate invocations "
        "(e.g. one device call per backend), with the ratios",
    )
    rep.add_argument("files", nargs="+")
    rep.add_argument("--out", default=str(RESULTS_DIR))

    plots = sub.add_parser("plots", help="PNG plots from throughput results JSON")
    plots.add_argument("files", nargs="+")
    plots.add_argument("--out", default=str(RESULTS_DIR))

    from .quant_bench import add_parser as add_quant_bench
    from .sampling_bench import add_parser as add_sampling_bench
    from .serve_bench import add_parser as add_serve_bench
    from .serve_soak import add_parser as add_serve_soak
    from .spec_bench import add_parser as add_spec_bench
    from .startup_bench import add_parser as add_startup_bench
    from .structured_bench import add_parser as add_structured_bench
    from .structured_eval import add_parser as add_structured

    add_serve_bench(sub, _common)
    add_serve_soak(sub, _common)
    add_spec_bench(sub, _common)
    add_sampling_bench(sub, _common)
    add_quant_bench(sub, _common)
    add_structured(sub, _common)
    add_structured_bench(sub, _common)
    add_startup_bench(sub, _common)

    cov = sub.add_parser(
        "coverage",
        help="every causal-LM type of the installed transformers as a tiny random model: "
        "exact / refused / differs / crashed against transformers' generate",
    )
    cov.add_argument("--types", action="append", help="model types, comma list (default: all)")
    cov.add_argument("--limit", type=int, default=None, help="the first N types only")
    cov.add_argument("--out", default=str(RESULTS_DIR), help="folder for JSON and markdown")
    cov.add_argument("--no-progress", action="store_true", help="no line per type")
    return parser


def _quiet_libraries() -> None:
    # Our own tqdm bars are the progress report; loaders' bars would interleave with them.
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:
        pass


def _save(out_dir: str, stem: str, payload: dict, markdown: str) -> Path:
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    path.with_suffix(".md").write_text(markdown + "\n")
    return path


ACCURACY_TASKS = {
    "sharegpt": "parity",
    "shakespeare": "perplexity",
    "date_understanding": "multiple_choice",
}


def _accuracy_task(dataset: str) -> str:
    """A named dataset's task, or a local file's by its columns: prompt -> greedy parity,
    text -> perplexity, input/choices/target -> multiple choice."""
    from .sources import dataset_path, load_json_dataset

    if dataset in ACCURACY_TASKS:
        return ACCURACY_TASKS[dataset]
    path = dataset_path(dataset)
    if not path.is_file() or path.suffix not in (".json", ".jsonl"):
        raise EvalError(
            f"unknown dataset {dataset!r} for accuracy: use "
            f"{', '.join(ACCURACY_TASKS)} or a .jsonl file"
        )
    columns = set(load_json_dataset(str(path)).column_names)
    if {"input", "choices", "target"} <= columns:
        return "multiple_choice"
    if "prompt" in columns:
        return "parity"
    if "text" in columns:
        return "perplexity"
    raise EvalError(f"{dataset}: needs a prompt, text or input/choices/target column")


def cmd_accuracy(args) -> int:
    from . import accuracy
    from .models import describe, load_model

    datasets_ = _csv(args.dataset, "sharegpt,shakespeare,date_understanding")
    vias = _csv(args.backend, "paged")
    for b in vias:
        if b not in ("paged", "generate"):
            raise EvalError(
                f"accuracy backend {b!r}: use paged (hf_paged.Engine) or generate "
                "(hf_paged.patch + model.generate; greedy parity only)"
            )
    tasks = {d: _accuracy_task(d) for d in datasets_}  # checked before loading the model
    results, desc = [], ""
    progress = not args.no_progress
    for dtype in _csv([args.dtype], "float32"):
        loaded = load_model(args.model, dtype, args.device)
        desc = describe(loaded)
        m, tok = loaded.model, loaded.tokenizer
        for d, task in tasks.items():
            if task == "parity":
                rs = accuracy.greedy_parity(
                    m,
                    tok,
                    n=args.limit or 16,
                    vias=tuple(vias),
                    max_new_tokens=args.max_new_tokens,
                    progress=progress,
                    dataset=d,
                )
            elif task == "perplexity":
                rs = [
                    accuracy.perplexity(
                        m,
                        tok,
                        num_windows=args.limit or 8,
                        window=args.window,
                        title=args.text,
                        progress=progress,
                        dataset=d,
                    )
                ]
            else:
                rs = [
                    accuracy.date_understanding(
                        m, tok, limit=args.limit, progress=progress, dataset=d
                    )
                ]
            results += [r | {"dtype": dtype} for r in rs]
    table = accuracy.format_accuracy(results, desc.rsplit(",", 2)[0] + ")")
    print(table)
    payload = {"argv": sys.argv, "model": desc, "results": results}
    path = _save(args.out, f"accuracy-{time.strftime('%Y%m%d-%H%M%S')}", payload, table)
    print(f"\nresults: {path}")
    return 0


def cmd_throughput(args) -> int:
    from . import plots
    from .backends import BACKENDS
    from .models import describe, load_model, load_tokenizer_for_workloads
    from .roofline import detect_hardware
    from .throughput import format_table, run_throughput
    from .workloads import build_workload, check_workload_name

    backends = _csv(args.backend, ",".join(BACKENDS))
    for b in backends:
        if b not in BACKENDS:
            raise EvalError(f"unknown backend {b!r}: use {', '.join(BACKENDS)}")
    try:
        concs = [int(c) for c in _csv([args.concurrency], "")] or [None]
    except ValueError:
        raise EvalError(f"--concurrency must be integers, got {args.concurrency!r}") from None
    names = _csv(args.dataset, "synthetic")
    for name in names:
        check_workload_name(name)  # bad input fails before minutes of model loading
    loaded = load_model(args.model, args.dtype, args.device, bnb=args.bnb)
    device = next(loaded.model.parameters()).device
    limit, max_new = args.limit, args.max_new_tokens
    if device.type == "cpu" and not args.full and limit is None and max_new is None:
        limit, max_new = CPU_DEFAULT_LIMIT, CPU_DEFAULT_MAX_NEW_TOKENS
        print(f"(CPU: shortened to --limit {limit} --max-new-tokens {max_new}; --full for all)")
    cfg = loaded.model.config.get_text_config()
    hw = detect_hardware(device, args.bandwidth_gbs, args.tflops)
    engine_options = {
        k: v
        for k, v in (
            ("num_blocks", args.num_blocks),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("compile", {"auto": None, "on": True, "off": False}[args.compile]),
            ("compile_scope", args.compile_scope),
            ("async_scheduling", args.async_scheduling),
            ("fuse_projections", args.fuse_projections),
            ("small_batch_rows", args.small_batch_rows),
            ("quantization", args.quantization),
            ("kv_cache_dtype", args.kv_cache_dtype),
        )
        if v is not None
    }
    desc = describe(loaded)
    results, tables = [], []
    stem = f"throughput-{loaded.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for name in names:
        wl = build_workload(
            name,
            cfg.vocab_size,
            lambda: load_tokenizer_for_workloads(loaded),
            cfg.max_position_embeddings,
            seed=args.seed,
        )
        wl = wl.limited(limit).with_max_new_tokens(max_new)
        res = run_throughput(loaded, wl, backends, concs, hw, not args.no_progress, engine_options)
        table = format_table(res, desc)
        print(table + "\n", flush=True)
        results.append(res)
        tables.append(table)
        # Saved after every workload: a run cut short by a time limit keeps what finished.
        path = _save(
            args.out,
            stem,
            {"argv": sys.argv, "model": desc, "results": results},
            "\n\n".join(tables),
        )
    print(f"results: {path}")
    if not args.no_plots:
        try:
            for i, res in enumerate(results):
                for png in plots.plot_result(res, path.parent, f"{path.stem}-{i}"):
                    print(f"plot: {png}")
        except EvalError as exc:  # plots are a bonus: never lose the numbers over them
            print(f"(no plots: {exc})")
    return 0


def cmd_report(args) -> int:
    from .throughput import format_table, merge_results

    loaded = []
    for name in args.files:
        try:
            payload = json.loads(Path(name).read_text())
            loaded.append((name, payload["model"], payload["results"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise EvalError(f"{name}: not a throughput results file ({exc})") from None
    models = {model for _, model, _ in loaded}
    if len(models) > 1:
        raise EvalError(f"results are for different models: {sorted(models)}")
    merged = merge_results([(name, results) for name, _, results in loaded])
    desc = models.pop()
    tables = [format_table(res, desc) for res in merged]
    note = "- merged from separate invocations: " + ", ".join(Path(f).name for f in args.files)
    tables = [t + "\n" + note for t in tables]
    print("\n\n".join(tables))
    stem = f"report-{time.strftime('%Y%m%d-%H%M%S')}"
    path = _save(
        args.out, stem, {"argv": sys.argv, "model": desc, "results": merged}, "\n\n".join(tables)
    )
    print(f"results: {path}")
    return 0


def cmd_export(args) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from .sources import smollm2_dir
    from .workloads import build_workload

    # Only SmolLM2's tokenizer and config are needed (no weights); the GPU machine folds the ids
    # into its model's vocabulary when it loads the file.
    if args.model != "smollm2":
        raise EvalError("export-workload tokenizes with SmolLM2: use --model smollm2")
    folder = smollm2_dir()
    cfg = AutoConfig.from_pretrained(folder)
    wl = build_workload(
        args.dataset,
        cfg.vocab_size,
        lambda: AutoTokenizer.from_pretrained(folder),
        2048,
        seed=args.seed,
    )
    wl = wl.limited(args.limit)
    Path(args.file).parent.mkdir(parents=True, exist_ok=True)
    wl.save(args.file)
    print(f"{wl.summary()}\nsaved: {args.file}")
    return 0


def cmd_coverage(args) -> int:
    import torch

    from .coverage import counts, format_table, run_coverage, select_types

    types = select_types(_csv(args.types, "") or None, args.limit)
    torch.set_num_threads(1)  # ~200 tiny models: threads only add contention
    rows = run_coverage(types, progress=not args.no_progress)
    table = format_table(rows)
    print(table)
    payload = {"argv": sys.argv, "counts": counts(rows), "rows": [asdict(r) for r in rows]}
    path = _save(args.out, f"coverage-{time.strftime('%Y%m%d-%H%M%S')}", payload, table)
    print(f"\nresults: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        if hasattr(args, "run"):  # a subcommand whose parser names its function
            return args.run(args, _save)
        if args.command == "accuracy":
            return cmd_accuracy(args)
        if args.command == "throughput":
            return cmd_throughput(args)
        if args.command == "export-workload":
            return cmd_export(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "coverage":
            return cmd_coverage(args)
        from . import plots

        for path in args.files:
            for png in plots.plot_file(path, Path(args.out)):
                print(f"plot: {png}")
        return 0
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
