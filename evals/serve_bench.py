"""`run.py serve-bench`: a workload through the OpenAI server by N concurrent streaming clients,
next to the same workload through the offline engine, in one invocation.

Per workload: the offline run (backends.run_paged: Engine.add_request/step, every request
submitted at t0) at max_num_seqs = clients; then a server on an Engine with the same options
(warmed up the same way), in this process as `hf-paged serve` runs it (uvicorn's event loop and
the engine loop thread), and the clients in a separate process (serve_client.py) so that they do
not take the GIL from the server. Every request streams (SSE), greedy, EOS ignored; TTFT is the
first chunk at the client, TPOT the time per token after it, token counts from the stream's
usage. batch1 runs one request at a time (batch-1 latency) on both sides.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .backends import BackendRun, RequestTiming, _check_lengths, run_paged
from .errors import EvalError
from .throughput import _fmt, metrics

HERE = Path(__file__).resolve().parent
CPU_DEFAULTS = {"limit": 64, "max_new_tokens": 32, "batch1_limit": 4}


def add_parser(sub, common) -> None:
    p = sub.add_parser(
        "serve-bench",
        help="N concurrent streaming clients against the OpenAI server vs the offline engine",
    )
    common(p, "auto", "auto")
    p.add_argument(
        "--dataset",
        action="append",
        help="synthetic (W1) | sharegpt | shared-prefix | batch1 | workload .json; comma list "
        "(default: synthetic,batch1)",
    )
    p.add_argument("--clients", type=int, default=256, help="concurrent clients (= max_num_seqs)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--full", action="store_true", help="on CPU, the full workloads")
    p.add_argument("--url", default=None, help="a running server: clients only, no offline run")
    p.add_argument("--served-model-name", default=None, help="with --url: the model to ask for")
    p.add_argument("--api-key", default=None, help="with --url")
    p.add_argument(
        "--engine-option", action="append", default=[], metavar="KEY=VALUE",
        help="an Engine option for both sides (num_blocks=4096, compile=False...)",
    )  # fmt: skip
    p.set_defaults(run=cmd_serve_bench)


def placeholder_tokenizer(vocab_size: int):
    """Random-weight shapes have no tokenizer: one word per id ("t123"), decoded joined by
    spaces, so the server detokenizes every token as it would a real model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0")


def tiny_model():
    """`--model tiny` (the CPU default): the tests' 2-layer Llama and tokenizer, seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_paged.testing import tiny_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval(), tiny_tokenizer()


def _server_run(model, tokenizer, wl, clients: int, options: dict, progress: bool) -> BackendRun:
    from hf_paged import SamplingParams
    from hf_paged.engine.engine import Engine
    from hf_paged.entrypoints.api_server import build_app
    from hf_paged.entrypoints.server_thread import ServerThread

    engine = Engine(model, tokenizer, max_num_seqs=clients, **options)
    try:
        warm = [r.prompt_token_ids for r in wl.requests[:8]]  # as run_paged: outside the clock
        engine.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.reset_prefix_cache()
        with ServerThread(build_app(engine, "bench", max_queued=len(wl.requests))) as server:
            timings, wall = _clients(server.url, "bench", wl, clients, None)
        stats = engine.stats()
    finally:
        engine.shutdown()
    extra = {"kv_usage": stats["peak_blocks_used"] / stats["num_blocks"], "engine_stats": stats}
    run = BackendRun("server", clients, timings, wall, extra=extra)
    _check_lengths(run, wl)  # every token of every request reached its client
    return run


def _clients(url: str, model: str, wl, clients: int, api_key: str | None):
    with tempfile.TemporaryDirectory() as tmp:
        wl.save(Path(tmp) / "workload.json")
        cmd = [sys.executable, str(HERE / "serve_client.py"), "--url", url, "--model", model]
        cmd += ["--workload", str(Path(tmp) / "workload.json"), "--clients", str(clients)]
        cmd += ["--out", str(Path(tmp) / "timings.json")]
        if api_key:
            cmd += ["--api-key", api_key]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise EvalError(f"the clients failed: {done.stderr.strip()[-2000:]}")
        data = json.loads((Path(tmp) / "timings.json").read_text())
    return [RequestTiming(**t) for t in data["timings"]], data["wall_s"]


def _options(pairs: list[str]) -> dict:
    from hf_paged.entrypoints.serve import _engine_option

    try:
        return dict(_engine_option(p) for p in pairs)
    except Exception as exc:
        raise EvalError(f"--engine-option: {exc}") from None


def cmd_serve_bench(args, save) -> int:
    from .models import describe, load_model, load_tokenizer_for_workloads
    from .workloads import Workload, build_workload, check_workload_name

    names = [n for v in args.dataset or ["synthetic,batch1"] for n in v.split(",") if n]
    for name in names:
        check_workload_name(name)
    options = _options(args.engine_option)
    if args.model == "tiny" or (args.model == "auto" and args.device in ("auto", "cpu")):
        import torch

        if args.model == "tiny" or not torch.cuda.is_available():
            args.model = "tiny"
    if args.model == "tiny":
        model, tokenizer = tiny_model()
        desc = "tiny (llama, 2 layers, hidden 64, vocab 256, float32, random weights)"
        wl_tokenizer = tokenizer
    else:
        loaded = load_model(args.model, args.dtype, args.device)
        model, desc = loaded.model, describe(loaded)
        tokenizer = loaded.tokenizer or placeholder_tokenizer(model.config.vocab_size)
        wl_tokenizer = loaded
    cpu = next(model.parameters()).device.type == "cpu"
    if cpu:
        import torch

        # One intra-op thread on both sides: on a busy 2-core machine two threads make every
        # small op wait for a core, and the engine loop thread and the main thread do not get
        # the same thread count, which made the offline side up to 10x slower than the server.
        torch.set_num_threads(1)
    cfg = model.config
    rows, results = [], []
    for name in names:
        wl = build_workload(
            name, cfg.vocab_size,
            lambda: wl_tokenizer if args.model == "tiny" else load_tokenizer_for_workloads(loaded),
            cfg.max_position_embeddings, seed=args.seed,
        )  # fmt: skip
        limit, max_new = args.limit, args.max_new_tokens
        if cpu and not args.full:
            batch1 = wl.max_concurrency == 1
            limit = limit or CPU_DEFAULTS["batch1_limit" if batch1 else "limit"]
            max_new = max_new or CPU_DEFAULTS["max_new_tokens"]
        wl: Workload = wl.limited(limit).with_max_new_tokens(max_new)
        clients = wl.max_concurrency or args.clients
        runs = []
        if args.url:
            model_name = args.served_model_name or args.model
            timings, wall = _clients(args.url, model_name, wl, clients, args.api_key)
            runs.append(BackendRun("server", clients, timings, wall))
            _check_lengths(runs[-1], wl)
        else:
            runs.append(run_paged(model, wl, clients, options, not args.no_progress))
            runs[-1].backend = "offline"
            runs.append(_server_run(model, tokenizer, wl, clients, options, False))
        ms = [metrics(r) for r in runs]
        results.append({"workload": wl.summary(), "clients": clients, "metrics": ms})
        rows.append((wl.summary(), ms))
        print(format_rows(desc, rows[-1:]), flush=True)
    table = format_rows(desc, rows)
    path = save(
        args.out,
        f"serve-bench-{time.strftime('%Y%m%d-%H%M%S')}",
        {"argv": sys.argv, "model": desc, "results": results},
        table,
    )
    print(f"\nresults: {path}")
    return 0


def format_rows(desc: str, rows) -> str:
    cols = ["run", "clients", "req", "out tok/s", "TTFT p50 ms", "TTFT p99 ms"]
    cols += ["TPOT p50 ms", "TPOT p99 ms", "wall s"]
    lines = ["## serve-bench", "", f"- model: {desc}", ""]
    for summary, ms in rows:
        lines += [f"### {summary}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for m in ms:
            row = [m["backend"], str(m["concurrency"]), str(m["num_requests"])]
            row += [_fmt(m["output_tok_s"]), _fmt(m["ttft_p50_ms"]), _fmt(m["ttft_p99_ms"])]
            row += [_fmt(m["tpot_p50_ms"], 2), _fmt(m["tpot_p99_ms"], 2), _fmt(m["wall_s"], 2)]
            lines.append("| " + " | ".join(row) + " |")
        by = {m["backend"]: m for m in ms}
        if "offline" in by and "server" in by:
            off, srv = by["offline"], by["server"]
            lines.append("")
            lines.append(
                f"- server / offline: **{srv['output_tok_s'] / off['output_tok_s']:.2f}x** output "
                f"tok/s; TPOT p50 {_fmt(srv['tpot_p50_ms'], 2)} vs {_fmt(off['tpot_p50_ms'], 2)} "
                "ms"
            )
        lines.append("")
    return "\n".join(lines)
