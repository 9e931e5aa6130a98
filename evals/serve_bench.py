"""`run.py serve-bench`: a workload through the OpenAI server by N concurrent streaming clients,
next to the same workload through the offline engine, in one invocation. With
`--engine-process on` the server's engine runs in a process of its own (`hf-paged serve
--engine-process`; run "server-proc"), `both` runs the two servers one after the other.

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

from . import step_profile
from .backends import BackendRun, RequestTiming, _check_lengths, run_paged
from .errors import EvalError
from .thread_clock import GcPauses, thread_cpu_s
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
    p.add_argument(
        "--stream-interval-ms", type=float, default=None,
        help="the server's hand-off pacing per live stream (hf-paged serve's option; "
        "default: its default)",
    )  # fmt: skip
    p.add_argument(
        "--engine-process", choices=("off", "on", "both"), default="off",
        help="the server's engine in a process of its own (hf-paged serve --engine-process), "
        "which loads the model again; both: one server run of each kind, same workload",
    )  # fmt: skip
    p.add_argument(
        "--cprofile", action="store_true",
        help="profile Engine.step() offline and in the engine process (--engine-process on): "
        "the top functions per step of each, to compare (evals/step_profile.py)",
    )  # fmt: skip
    p.add_argument(
        "--client-processes", type=int, default=1,
        help="load-generator processes sharing the clients (one parses every stream's events "
        "and can saturate; each one's CPU seconds are reported)",
    )  # fmt: skip
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


def _server_run(
    model, tokenizer, wl, clients: int, options: dict, progress: bool, interval_ms=None,
    client_processes: int = 1,
) -> BackendRun:  # fmt: skip
    from hf_paged import SamplingParams
    from hf_paged.engine.engine import Engine
    from hf_paged.entrypoints.api_server import build_app
    from hf_paged.entrypoints.server_thread import ServerThread
    from hf_paged.gc_freeze import frozen_heap

    engine = Engine(model, tokenizer, max_num_seqs=clients, **options)
    try:
        warm = [r.prompt_token_ids for r in wl.requests[:8]]  # as run_paged: outside the clock
        engine.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.reset_prefix_cache()
        pacing = {} if interval_ms is None else {"stream_interval_s": interval_ms / 1000}
        app = build_app(engine, "bench", max_queued=len(wl.requests), **pacing)
        # frozen as `hf-paged serve` freezes its heap (and run_paged its run): no collection
        # scans the model's objects while the clock runs
        front = app.state.front
        with frozen_heap(), ServerThread(app) as server, GcPauses() as gc_pauses:
            threads = {"engine": front._thread, "loop": server.thread}
            cpu0 = {k: thread_cpu_s(t) for k, t in threads.items()}
            timings, wall, client_cpu, _t0 = _clients(
                server.url, "bench", wl, clients, None, client_processes
            )
            cpu = {k: thread_cpu_s(t) - cpu0[k] for k, t in threads.items()}
        stats = engine.stats()
    finally:
        engine.shutdown()
    extra = {
        "kv_usage": stats["peak_blocks_used"] / stats["num_blocks"],
        "engine_stats": stats,
        # the engine loop thread: steps, time and its CPU time inside step(), hand-offs to the
        # event loop; and the steps taken until the last request arrived
        "num_steps": front.num_steps,
        "step_s": front.step_seconds,
        "step_cpu_s": front.step_cpu_seconds,
        "num_handoffs": front.num_handoffs,
        "arrivals": _arrivals(front.first_submit, front.last_submit),
        "thread_cpu_s": cpu,  # CPU seconds of the engine loop thread and the event loop
        "gc": gc_pauses.as_dict(),
        "client_cpu_s": client_cpu,  # each load-generator process's CPU seconds
    }
    run = BackendRun("server", clients, timings, wall, extra=extra)
    _check_lengths(run, wl)  # every token of every request reached its client
    return run


def _arrivals(first: tuple | None, last: tuple | None) -> dict | None:
    """The steps between the first request's arrival and the last one's: steps, time and CPU
    time inside step(), and how long the requests took to arrive."""
    if first is None:
        return None
    (t0, n0, s0, c0), (t1, n1, s1, c1) = first, last
    return {"span_s": t1 - t0, "num_steps": n1 - n0, "step_s": s1 - s0, "step_cpu_s": c1 - c0}


def _timeline(t0: float, loop: dict) -> dict | None:
    """The engine process's run on the clients' clock (seconds from their start, t0): when the
    first and the last request reached the engine, when its last step ended, and the time its
    loop spent outside step() from the first request to the last step (its own work between
    steps: taking messages in, encoding and queueing outputs)."""
    first, last, end = loop["first_add"], loop["last_add"], loop.get("last_step_end")
    if first is None or last is None or end is None:
        return None
    steps = loop["num_steps"] - first[1]
    return {
        "first_in_s": first[0] - t0,
        "last_in_s": last[0] - t0,
        "last_step_s": end - t0,
        "outside_step_s": (end - first[0]) - (loop["step_s"] - first[2]),
        "num_steps": steps,
    }


def child_model(model: str, dtype: str, device: str):
    """The engine process's (model, tokenizer): what cmd_serve_bench loads, loaded again there
    (through hf_paged.testing.evals_call; the model never crosses processes)."""
    if model == "tiny":
        import torch

        torch.set_num_threads(1)  # as the parent on CPU (cmd_serve_bench)
        return tiny_model()
    from .models import load_model

    loaded = load_model(model, dtype, device)
    if next(loaded.model.parameters()).device.type == "cpu":
        import torch

        torch.set_num_threads(1)
    return loaded.model, loaded.tokenizer or placeholder_tokenizer(loaded.model.config.vocab_size)


def warm_up(prompts: list[list[int]], engine) -> None:
    """As run_paged and the in-process server: a slice of the workload, outside the clock."""
    from hf_paged import SamplingParams

    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.reset_prefix_cache()


def _give_back_device_memory() -> None:
    """The earlier runs' KV caches and graphs, freed but still in this process's CUDA caching
    allocator, back to the device: the engine process sizes its KV cache from what the device
    has free, and memory this process keeps reserved is not free there."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def child_loader(*load_args):
    """A picklable load() for EngineSpec: child_model(*load_args) in the engine process."""
    import functools

    from hf_paged.testing import evals_call

    return functools.partial(evals_call, "serve_bench", "child_model", *load_args)


def _process_server_run(
    load, tokenizer, wl, clients: int, options: dict, profile=None, client_processes: int = 1
):
    """The server with its engine in a process of its own (hf-paged serve --engine-process):
    the engine process runs load() (picklable: child_loader) and warms up as the others do;
    this process runs uvicorn and the front. profile: a file for the engine process's step()
    profile (step_profile.py), written when it exits."""
    import functools

    from hf_paged.entrypoints.api_server import build_app
    from hf_paged.entrypoints.core_messages import EngineSpec
    from hf_paged.entrypoints.engine_client import EngineProcess
    from hf_paged.entrypoints.server_thread import ServerThread
    from hf_paged.gc_freeze import frozen_heap
    from hf_paged.testing import evals_call

    _give_back_device_memory()
    warm = [r.prompt_token_ids for r in wl.requests[:8]]
    if profile is None:
        setup = functools.partial(evals_call, "serve_bench", "warm_up", warm)
    else:
        setup = functools.partial(
            evals_call, "step_profile", "profile_in_engine_process", profile, warm
        )
    spec = EngineSpec(
        load,
        {**options, "max_num_seqs": clients},
        setup,
    )
    with EngineProcess(spec, tokenizer, max_queued=len(wl.requests)) as front:
        app = build_app(front, "bench")
        with frozen_heap(), ServerThread(app) as server, GcPauses() as gc_pauses:
            before = front.call("stats")["loop"]
            loop0 = thread_cpu_s(server.thread)
            timings, wall, client_cpu, t0 = _clients(
                server.url, "bench", wl, clients, None, client_processes
            )
            loop_cpu = thread_cpu_s(server.thread) - loop0
            stats = front.call("stats")
    after = stats.pop("loop")
    extra = {
        "kv_usage": stats["peak_blocks_used"] / stats["num_blocks"],
        "engine_stats": stats,
        # the engine process's step loop (steps, time and CPU time inside step(), the warm-up
        # left out) and the messages of outputs this process read from it
        "num_steps": after["num_steps"] - before["num_steps"],
        "step_s": after["step_s"] - before["step_s"],
        "step_cpu_s": after["step_cpu_s"] - before["step_cpu_s"],
        "num_handoffs": front.num_handoffs,
        "arrivals": _arrivals(after["first_add"], after["last_add"]),
        "timeline": _timeline(t0, after),
        # CPU seconds of the engine process's step loop thread and of this event loop
        "thread_cpu_s": {
            "engine": after["thread_cpu_s"] - before["thread_cpu_s"],
            "loop": loop_cpu,
        },
        # the step loop thread's waits for a core (None off Linux): what is left of the time in
        # step() beyond its CPU time and this is the device's (or a stub's) and the GIL's
        "engine_run_delay_s": (
            None
            if after["thread_run_delay_s"] is None
            else after["thread_run_delay_s"] - before["thread_run_delay_s"]
        ),
        "gc": gc_pauses.as_dict(),  # this process's (the engine process has its own)
        "engine_process": True,
        "client_cpu_s": client_cpu,
    }
    run = BackendRun("server-proc", clients, timings, wall, extra=extra)
    _check_lengths(run, wl)  # every token of every request reached its client
    return run


def _clients(url: str, model: str, wl, clients: int, api_key: str | None, processes: int = 1):
    """The load generator (serve_client.py) in `processes` processes of its own: each request's
    timings, the wall time, each process's CPU seconds, and the clients' start (perf_counter)."""
    with tempfile.TemporaryDirectory() as tmp:
        wl.save(Path(tmp) / "workload.json")
        cmd = [sys.executable, str(HERE / "serve_client.py"), "--url", url, "--model", model]
        cmd += ["--workload", str(Path(tmp) / "workload.json"), "--clients", str(clients)]
        cmd += ["--out", str(Path(tmp) / "timings.json")]
        cmd += ["--processes", str(min(processes, clients))]  # batch 1 runs one client
        if api_key:
            cmd += ["--api-key", api_key]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise EvalError(f"the clients failed: {done.stderr.strip()[-2000:]}")
        data = json.loads((Path(tmp) / "timings.json").read_text())
    timings = [RequestTiming(**t) for t in data["timings"]]
    return timings, data["wall_s"], data["cpu_s"], data["t0"]


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
    if args.client_processes < 1:
        raise EvalError(f"--client-processes must be >= 1, got {args.client_processes}")
    if args.model == "tiny" or (args.model == "auto" and args.device in ("auto", "cpu")):
        import torch

        if args.model == "tiny" or not torch.cuda.is_available():
            args.model = "tiny"
    load_args = (args.model, args.dtype, args.device)  # an engine process loads the same
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
        profiles = []  # --cprofile: step() tables of this workload's runs
        if args.url:
            model_name = args.served_model_name or args.model
            timings, wall, client_cpu, _t0 = _clients(
                args.url, model_name, wl, clients, args.api_key, args.client_processes
            )
            runs.append(BackendRun("server", clients, timings, wall))
            runs[-1].extra["client_cpu_s"] = client_cpu
            _check_lengths(runs[-1], wl)
        else:
            offline_profile = step_profile.StepProfile() if args.cprofile else None
            with step_profile.profiled_engine_steps(offline_profile):
                runs.append(run_paged(model, wl, clients, options, not args.no_progress))
            runs[-1].backend = "offline"
            if offline_profile is not None:
                profiles.append(offline_profile.table("step() profile, offline"))
            if args.engine_process in ("off", "both"):
                interval = args.stream_interval_ms
                run_args = (model, tokenizer, wl, clients, options, False, interval)
                runs.append(_server_run(*run_args, args.client_processes))
            if args.engine_process in ("on", "both"):
                load = child_loader(*load_args)
                with tempfile.TemporaryDirectory() as tmp:
                    path = str(Path(tmp) / "engine-process.prof") if args.cprofile else None
                    run_args = (load, tokenizer, wl, clients, options, path)
                    runs.append(_process_server_run(*run_args, args.client_processes))
                    if path is not None:
                        loaded = step_profile.load(path)
                        profiles.append(
                            step_profile.table("step() profile, engine process", *loaded)
                        )
        ms = [metrics(r) for r in runs]
        results.append({"workload": wl.summary(), "clients": clients, "metrics": ms})
        rows.append((wl.summary(), ms))
        print(format_rows(desc, rows[-1:]), flush=True)
        if profiles:
            print("\n\n".join(profiles) + "\n", flush=True)
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
    lines = ["## serve-bench", "", f"- model: {desc}", f"- server: uvicorn on {_http_stack()}", ""]
    for summary, ms in rows:
        lines += [f"### {summary}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for m in ms:
            row = [m["backend"], str(m["concurrency"]), str(m["num_requests"])]
            row += [_fmt(m["output_tok_s"]), _fmt(m["ttft_p50_ms"]), _fmt(m["ttft_p99_ms"])]
            row += [_fmt(m["tpot_p50_ms"], 2), _fmt(m["tpot_p99_ms"], 2), _fmt(m["wall_s"], 2)]
            lines.append("| " + " | ".join(row) + " |")
        by = {m["backend"]: m for m in ms}
        off = by.get("offline")
        for name in ("server", "server-proc"):  # engine thread; engine process
            if off is None or name not in by:
                continue
            srv = by[name]
            lines.append("")
            lines.append(
                f"- {name} / offline: **{srv['output_tok_s'] / off['output_tok_s']:.2f}x** "
                f"output tok/s; TPOT p50 {_fmt(srv['tpot_p50_ms'], 2)} vs "
                f"{_fmt(off['tpot_p50_ms'], 2)} ms"
            )
            lines.append(_engine_line(off, srv))
        lines.append("")
    return "\n".join(lines)


def _engine_line(off: dict, srv: dict) -> str:
    """Where the server's time went: its engine loop's steps (time inside step() per step, and
    the engine thread's CPU time in it: the rest is waiting, for the device or for the GIL) and
    its hand-offs to the event loop, next to the offline engine's steps (its wall time per step:
    nothing else runs); the steps while requests still arrived apart; the threads' CPU seconds
    and the garbage collector's pauses (every thread waits through one)."""
    o, s = off["extra"], srv["extra"]
    if not o.get("num_steps") or not s.get("num_steps"):
        return "- engine: step counts not recorded"
    line = (
        f"- engine: offline {o['num_steps']} steps, {1000 * off['wall_s'] / o['num_steps']:.2f} "
        f"ms/step{_per_step(' (CPU ', o.get('cpu_s'), o['num_steps'], ')')}; {srv['backend']} "
        f"{s['num_steps']} steps, {1000 * s['step_s'] / s['num_steps']:.2f} ms in step() per "
        f"step{_per_step(' (CPU ', s.get('step_cpu_s'), s['num_steps'], ')')}, "
        f"{s['num_handoffs']} hand-offs to the event loop"
    )
    a = s.get("arrivals")
    if a and a["num_steps"] and s["num_steps"] > a["num_steps"]:
        n = s["num_steps"] - a["num_steps"]
        line += (
            f"; while requests arrived ({1000 * a['span_s']:.0f} ms): {a['num_steps']} steps, "
            f"{1000 * a['step_s'] / a['num_steps']:.2f} ms in step() (CPU "
            f"{1000 * a['step_cpu_s'] / a['num_steps']:.2f}), after: {n} steps, "
            f"{1000 * (s['step_s'] - a['step_s']) / n:.2f} ms (CPU "
            f"{1000 * (s['step_cpu_s'] - a['step_cpu_s']) / n:.2f})"
        )
    tl = s.get("timeline")
    if tl:
        line += (
            f"; from the clients' start: first request in the engine at "
            f"{1000 * tl['first_in_s']:.1f} ms, the last at {1000 * tl['last_in_s']:.1f}, "
            f"last step done at {1000 * tl['last_step_s']:.1f}, last token read at "
            f"{1000 * srv['wall_s']:.1f}; the loop outside step() "
            f"{1000 * tl['outside_step_s']:.1f} ms over {tl['num_steps']} steps"
        )
    if s.get("thread_cpu_s"):
        t = s["thread_cpu_s"]
        line += f"; CPU s: engine thread {t['engine']:.2f}, event loop {t['loop']:.2f}"
    if s.get("engine_run_delay_s") is not None:
        line += f"; engine process's loop waited {s['engine_run_delay_s']:.2f} s for a core"
    if "gc" in o and "gc" in s:
        line += f"; GC pauses: offline {_gc(o['gc'])}, {srv['backend']} {_gc(s['gc'])}"
    if s.get("client_cpu_s"):  # a load generator near 100% of a core is what limited the run
        cpu = s["client_cpu_s"]
        line += (
            f"; load generator: {len(cpu)} process{'es' if len(cpu) > 1 else ''}, the busiest "
            f"{max(cpu):.2f} s CPU in the {srv['wall_s']:.2f} s run"
        )
    return line


def _per_step(head: str, seconds: float | None, steps: int, tail: str) -> str:
    return "" if seconds is None else f"{head}{1000 * seconds / steps:.2f} ms{tail}"


def _gc(pauses: dict) -> str:
    by, full = pauses["by_thread"], pauses["full"]
    total = sum(v["seconds"] for v in by.values())
    count = sum(v["count"] for v in by.values())
    parts = ", ".join(f"{name} {1000 * v['seconds']:.0f}" for name, v in sorted(by.items()))
    return (
        f"{1000 * total:.0f} ms in {count}"
        + (f" ({parts})" if len(by) > 1 else "")
        + f", {full['count']} full: {1000 * full['seconds']:.0f} ms"
    )


def _http_stack() -> str:
    """What uvicorn runs on here: it picks uvloop and httptools when they are installed (the
    serve extra), else asyncio's loop and h11, whose Python per chunk costs the engine GIL time."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"{loop} + {http}"
