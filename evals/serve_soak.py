"""`run.py serve-soak`: the OpenAI server under steady mixed load for minutes, its memory watched.

It starts `hf-paged serve` as a process of its own (`--model tiny`: the tests' 2-layer Llama and
tokenizer saved to a temporary folder, with --adapters random LoRA adapters served beside it;
or a model folder), keeps --clients concurrent clients
busy for --minutes (soak_clients.py: streams read to the end, non-streamed n = 2, streams the
client drops after the first event, bad requests), and every --interval seconds samples the
server process's resident memory (/proc/PID/statm; with --engine-process its engine process's
too) and its /metrics (KV usage, running and waiting requests, sequences in flight).

It passes (exit status 0) when all three hold:
- no error: every request got what it should (soak_clients.py says what is checked);
- drained: within 30 s of the clients stopping, /metrics shows no sequence in flight, nothing
  running or waiting and a KV usage of 0 (every block back in the pool);
- flat memory (flat_memory; with --engine-process, in each process): with the first fifth of
  the run as warm-up, the median RSS of the last fifth is within 2% of the median of the fifth
  after the warm-up, and the least-squares trend of RSS over everything after the warm-up, times
  its span, is within 2% of its mean (a leak shows as a trend even when the two ends happen to
  land close).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .errors import EvalError
from .soak_clients import SoakClients

API_KEY = "soak-key"
MODEL = "soak"
TOLERANCE = 0.02  # flat memory: growth and trend each within 2% of the RSS
DRAIN_TIMEOUT_S = 30.0
MIB = 1 << 20


def add_parser(sub, common) -> None:
    p = sub.add_parser(
        "serve-soak", help="the server under mixed load for minutes: errors, blocks, flat memory"
    )
    common(p, "tiny", "auto")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=8, help="concurrent client loops")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--server-threads", type=int, default=1, help="the server's torch threads")
    p.add_argument(
        "--adapters", type=int, default=0,
        help="with --model tiny: N random peft LoRA adapters served as models lora0..; "
        "requests pick the base or one of them",
    )  # fmt: skip
    p.add_argument(
        "--engine-option", action="append", default=[], metavar="KEY=VALUE",
        help="an Engine option for the server (num_blocks=512, ...)",
    )  # fmt: skip
    p.add_argument(
        "--engine-process", action="store_true",
        help="hf-paged serve --engine-process: the engine in a process of its own, whose memory "
        "is watched too",
    )  # fmt: skip
    p.set_defaults(run=cmd_serve_soak)


def flat_memory(times: list[float], rss: list[float], duration: float) -> dict:
    """The flat-memory verdict on (time s, RSS bytes) samples of a run of `duration` s."""
    fifth = duration / 5
    after = [(t, r) for t, r in zip(times, rss) if t >= fifth]
    early = [r for t, r in after if t < 2 * fifth]
    late = [r for t, r in after if t >= duration - fifth]
    if len(after) < 4 or not early or not late:
        raise EvalError("too few memory samples for a verdict: a longer run or a shorter interval")
    base = statistics.median(early)
    growth = (statistics.median(late) - base) / base
    ts, rs = [t for t, _ in after], [r for _, r in after]
    slope = statistics.linear_regression(ts, rs).slope  # bytes per second
    trend = slope * (ts[-1] - ts[0]) / statistics.fmean(rs)
    return {
        "pass": growth <= TOLERANCE and trend <= TOLERANCE,
        "early_mib": base / MIB,
        "late_mib": statistics.median(late) / MIB,
        "growth_pct": 100 * growth,
        "trend_pct": 100 * trend,
        "rule": f"warm-up {fifth:.0f} s; late/early median growth and least-squares trend "
        f"each <= {100 * TOLERANCE:.0f}%",
    }


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def engine_process_of(pid: int) -> int | None:
    """The engine process `hf-paged serve --engine-process` (pid) spawned: its child started by
    multiprocessing's spawn (not multiprocessing's resource tracker)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):  # gone meanwhile
            continue
        if b"spawn_main" in cmdline:
            return int(stat.parent.name)
    return None


def _get(url: str, path: str) -> bytes:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


def _metrics(url: str) -> dict[str, float]:
    """The unlabelled hf_paged: gauges and counters of /metrics."""
    out = {}
    for line in _get(url, "/metrics").decode().splitlines():
        if line.startswith("hf_paged:") and "{" not in line:
            name, value = line.split()
            out[name.removeprefix("hf_paged:")] = float(value)
    return out


def _sample(url: str, pid: int, t: float, engine_pid: int | None = None) -> dict:
    m = _metrics(url)
    extra = {} if engine_pid is None else {"engine_rss_mib": round(_rss(engine_pid) / MIB, 2)}
    return {
        "t": round(t, 1),
        "rss_mib": round(_rss(pid) / MIB, 2),
        **extra,
        "kv_usage": m["kv_cache_usage_perc"],
        "running": int(m["num_requests_running"]),
        "waiting": int(m["num_requests_waiting"]),
        "in_flight": int(m["num_sequences_in_flight"]),
    }


def _drained(s: dict) -> bool:
    return s["in_flight"] == 0 and s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0


class _Server:
    """`hf-paged serve` in a process of its own, with its log in a file."""

    def __init__(self, model_dir: str, args, port: int, log_path: Path, loras: list[str]) -> None:
        cmd = [sys.executable, "-m", "hf_paged.entrypoints.serve", model_dir, "--port", str(port)]
        cmd += [x for lora in loras for x in ("--lora", lora)]
        cmd += ["--api-key", API_KEY, "--served-model-name", MODEL, "--log-level", "warning"]
        if args.dtype != "auto":
            cmd += ["--dtype", args.dtype]
        if args.device != "auto":
            cmd += ["--device-map", args.device]
        for option in args.engine_option:
            cmd += ["--engine-option", option]
        if args.engine_process:
            cmd += ["--engine-process"]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.server_threads)}
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.engine_process, self.engine_pid = args.engine_process, None

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EvalError(f"the server exited: {self.log_path.read_text()[-2000:]}")
            try:
                _get(self.url, "/health")
                self.engine_pid = engine_process_of(self.proc.pid) if self.engine_process else None
                if self.engine_process and self.engine_pid is None:
                    raise EvalError("--engine-process: the server has no engine process")
                return
            except OSError:
                time.sleep(0.5)
        raise EvalError("the server did not answer /health in time")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def _soak(server: _Server, clients: SoakClients, args, seconds: float):
    samples = []
    t0 = time.monotonic()
    work = asyncio.ensure_future(clients.run(args.clients, seconds))
    while not work.done():
        s = await asyncio.to_thread(
            _sample, server.url, server.proc.pid, time.monotonic() - t0, server.engine_pid
        )
        samples.append(s)
        print(_row(s), flush=True)
        await asyncio.wait({work}, timeout=args.interval)
    tally = work.result()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        end = await asyncio.to_thread(
            _sample, server.url, server.proc.pid, time.monotonic() - t0, server.engine_pid
        )
        if _drained(end) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    return samples, tally, end


def _row(s: dict) -> str:
    engine = f" {s['engine_rss_mib']:.1f} |" if "engine_rss_mib" in s else ""
    return (
        f"| {s['t']:.0f} | {s['rss_mib']:.1f} |{engine} {100 * s['kv_usage']:.1f} | "
        f"{s['running']} | {s['waiting']} | {s['in_flight']} |"
    )


def _model_dir(args, tmp: str) -> str:
    if args.model != "tiny":
        if not Path(args.model).is_dir():
            raise EvalError(f"--model: 'tiny' or a model folder, got {args.model!r}")
        if args.adapters:
            raise EvalError("--adapters: random adapters are built for --model tiny only")
        return args.model
    from .serve_bench import tiny_model

    model, tokenizer = tiny_model()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return tmp


def _tiny_adapters(n: int, tmp: str) -> list[str]:
    """n rank-4 LoRA adapters on the tiny model's q/v projections, saved as peft saves them;
    lora_B drawn at random (peft starts it at zero: no effect). Returns `--lora` values."""
    import torch
    from peft import LoraConfig, get_peft_model

    from .serve_bench import tiny_model

    out = []
    for i in range(n):
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(tiny_model()[0], config)
        torch.manual_seed(i)
        for module in model.modules():
            for linear in getattr(module, "lora_B", {}).values():
                torch.nn.init.normal_(linear.weight, std=0.5)
        model.save_pretrained(Path(tmp) / f"lora{i}")
        out.append(f"lora{i}={Path(tmp) / f'lora{i}'}")
    return out


def cmd_serve_soak(args, save) -> int:
    from hf_paged.entrypoints.server_thread import free_port

    seconds = 60 * args.minutes
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args, tmp)
        loras = _tiny_adapters(args.adapters, tmp)
        models = [MODEL] + [lora.split("=")[0] for lora in loras]
        config = json.loads((Path(model_dir) / "config.json").read_text())
        server = _Server(model_dir, args, free_port(), Path(tmp) / "server.log", loras)
        try:
            server.wait_ready()
            card = json.loads(_get(server.url, f"/v1/models/{MODEL}"))
            vocab, max_len = config.get("vocab_size", 256), card["max_model_len"]
            clients = SoakClients(server.port, models, API_KEY, vocab, max_len, args.seed)
            with_adapters = f" + {args.adapters} LoRA adapters" if args.adapters else ""
            print(
                f"## serve-soak: {args.model}{with_adapters}, {args.clients} clients, "
                f"{args.minutes} min\n"
            )
            cols = ["t s", "RSS MiB", "KV %", "running", "waiting", "in flight"]
            if args.engine_process:  # the API process's RSS, then the engine process's
                cols.insert(2, "engine RSS MiB")
            print("| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")
            samples, tally, end = asyncio.run(_soak(server, clients, args, seconds))
        finally:
            server.stop()
            server_log = server.log_path.read_text()[-4000:]
    times = [s["t"] for s in samples]
    memory = flat_memory(times, [s["rss_mib"] * MIB for s in samples], seconds)
    memories = [("", memory)]
    if args.engine_process:  # each process flat on its own: a leak in one cannot hide
        engine_rss = [s["engine_rss_mib"] * MIB for s in samples]
        memories.append(("engine process ", flat_memory(times, engine_rss, seconds)))
    drained = _drained(end)
    ok = all(m["pass"] for _, m in memories) and drained and tally.num_errors == 0
    lines = [
        "",
        f"- requests as expected: {dict(tally.outcomes)} ({sum(tally.outcomes.values())} in all,"
        f" {tally.output_tokens} output tokens read)",
        f"- errors: {tally.num_errors}" + "".join(f"\n  - {e}" for e in tally.errors),
        f"- after the clients stopped: {_row(end)} -> {'drained' if drained else 'NOT drained'}",
        *(
            f"- {who}memory: RSS {m['early_mib']:.1f} MiB after warm-up, {m['late_mib']:.1f} "
            f"MiB at the end ({m['growth_pct']:+.2f}%), trend {m['trend_pct']:+.2f}% "
            f"({m['rule']}) -> {'flat' if m['pass'] else 'NOT flat'}"
            for who, m in memories
        ),
        f"- verdict: **{'PASS' if ok else 'FAIL'}**",
    ]
    print("\n".join(lines), flush=True)
    if not ok and server_log.strip():
        print(f"\nserver log (tail):\n{server_log}")
    payload = {
        "argv": sys.argv, "samples": samples, "end": end, "memory": memory, "drained": drained,
        "engine_memory": memories[1][1] if len(memories) > 1 else None,
        "outcomes": dict(tally.outcomes), "errors": tally.errors, "num_errors": tally.num_errors,
        "output_tokens": tally.output_tokens, "pass": ok,
    }  # fmt: skip
    path = save(args.out, f"serve-soak-{time.strftime('%Y%m%d-%H%M%S')}", payload, "\n".join(lines))
    print(f"\nresults: {path}")
    return 0 if ok else 1
