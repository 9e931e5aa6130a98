"""What the OpenAI server costs the engine, on any machine: the offline engine and the server
(uvicorn's event loop and the engine loop thread in one process, the clients in another, as
`run.py serve-bench` runs them) on many short streams, with the model's forward replaced by a
stub that sleeps without the GIL (a GPU step's wait: --gpu-ms a step plus --gpu-us-per-token for
each token it computes, so prefill steps cost more) and picks a token from the position, so the
token rate is the GPU's and not a CPU forward's.

    python evals/profiling/serve_overhead.py [--clients 256] [--new-tokens 128] [--gpu-ms 2]
        [--gpu-us-per-token 0] [--prompt-len 8,24] [--stream-interval-ms 0.5,0]
        [--engine-process]

Per run: output tok/s, TPOT p50, TTFT p50, the engine's steps with the wall time and the engine
thread's CPU time inside step() per step, and serve-bench's engine line (the steps while
requests still arrived apart, the CPU seconds of the engine loop thread and the event loop, the
garbage collector's pauses); then the time in step() per step split into the engine thread's
CPU, the stub's sleep, its wait for a core (Linux's run delay: a busy machine's) and what is
left, its wait for the GIL. A 2-layer, 64-wide Llama with a 256-token vocabulary stands in for
the model. --engine-process adds a server run with the engine (and the stub) in a process of its
own (`hf-paged serve --engine-process`); its engine line is that process's step loop.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


class StepWaits:
    """Inside Engine.step(), per step: wall, this thread's CPU, its wait for a core (Linux's
    schedstat run delay) and the stub's nominal sleep; what is left is the wait for the GIL."""

    def __init__(self) -> None:
        self.steps, self.wall, self.cpu, self.core, self.sleep = 0, 0.0, 0.0, 0.0, 0.0

    def wrap(self, step):
        def timed(engine):
            t, c, q = time.perf_counter(), time.thread_time(), _run_delay()
            try:
                return step(engine)
            finally:
                self.steps += 1
                self.wall += time.perf_counter() - t
                self.cpu += time.thread_time() - c
                self.core += _run_delay() - q

        return timed

    def line(self) -> str:
        n = max(self.steps, 1)
        gil = self.wall - self.cpu - self.core - self.sleep
        return (
            f"in step() per step: {1000 * self.wall / n:.2f} ms = CPU {1000 * self.cpu / n:.2f} "
            f"+ stub sleep {1000 * self.sleep / n:.2f} + waiting for a core "
            f"{1000 * self.core / n:.2f} + for the GIL {1000 * gil / n:.2f}"
        )


def _run_delay() -> float:
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:  # not Linux: counted as GIL wait
        return 0.0


def _stub_forward(gpu_s: float, per_token_s: float, vocab: int, waits: list):
    def forward(self, model, ids, pos, keep):
        wait = gpu_s + per_token_s * ids.numel()
        waits[0].sleep += wait
        time.sleep(wait)  # without the GIL, as a GPU wait
        p = pos[keep]
        logits = torch.zeros(p.shape[0], vocab)
        logits[torch.arange(p.shape[0]), p % (vocab - 16) + 8] = 1.0
        return logits

    return forward


def stub_model(gpu_s: float, per_token_s: float):
    """The engine process's (model, tokenizer) with --engine-process: the tiny model with the
    stub forward installed there (this process's patch does not cross processes)."""
    from hf_paged_evals.serve_bench import tiny_model

    from hf_paged.worker.model_forward import ModelForward

    torch.set_num_threads(1)
    model, tokenizer = tiny_model()
    waits = [StepWaits()]  # not reported: the engine process's loop reports its own steps
    ModelForward._call_model = _stub_forward(gpu_s, per_token_s, model.config.vocab_size, waits)
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--gpu-ms", type=float, default=2.0, help="the stub's GIL-free wait per step")
    p.add_argument(
        "--gpu-us-per-token", type=float, default=0.0,
        help="and per token the step computes (prefill; W1 on the H200: ~2.6)",
    )  # fmt: skip
    p.add_argument("--prompt-len", default="8,24", help="prompt tokens: MIN,MAX (W1: 66,511)")
    p.add_argument("--stream-interval-ms", default="0.5,0", help="server runs: a comma list")
    p.add_argument(
        "--engine-process", action="store_true",
        help="and a server run with the engine in a process of its own (the stub there too)",
    )  # fmt: skip
    args = p.parse_args(argv)

    import bench_setup  # noqa: F401 (evals/ as the package hf_paged_evals)
    from hf_paged_evals.backends import run_paged
    from hf_paged_evals.serve_bench import _engine_line, _server_run, tiny_model
    from hf_paged_evals.throughput import metrics
    from hf_paged_evals.workloads import Workload, WorkloadRequest

    from hf_paged.engine.engine import Engine
    from hf_paged.worker.model_forward import ModelForward

    torch.set_num_threads(1)
    model, tokenizer = tiny_model()
    waits = [StepWaits()]  # the current run's (the warm-ups' steps count in it too)
    ModelForward._call_model = _stub_forward(
        args.gpu_ms / 1000, args.gpu_us_per_token / 1e6, model.config.vocab_size, waits
    )
    step = Engine.step
    Engine.step = lambda engine: waits[0].wrap(step)(engine)
    rng = random.Random(0)
    lo, hi = (int(v) for v in args.prompt_len.split(","))
    requests = [
        WorkloadRequest(
            [rng.randrange(3, 256) for _ in range(rng.randint(lo, hi))], args.new_tokens
        )
        for _ in range(args.clients)
    ]
    wl = Workload("short", requests, "short prompts", None, {})
    options = {"verify_model": False}  # the stub is not the model the check would compare

    off = run_paged(model, wl, args.clients, options, False)
    off.backend = "offline"
    m_off = metrics(off)
    base = m_off["output_tok_s"]
    print(
        f"{args.clients} streams x {args.new_tokens} tokens, forward stub {args.gpu_ms} ms + "
        f"{args.gpu_us_per_token} us/token"
    )
    print(
        f"offline                 {base:9,.0f} tok/s  TPOT p50 {m_off['tpot_p50_ms']:6.2f} ms  "
        f"TTFT p50 {m_off['ttft_p50_ms']:7.1f} ms  {off.extra['num_steps']} steps, "
        f"{1000 * off.wall_s / off.extra['num_steps']:.2f} ms/step (CPU "
        f"{1000 * off.extra['cpu_s'] / off.extra['num_steps']:.2f})"
    )
    print("  " + waits[0].line())
    for interval in [float(v) for v in args.stream_interval_ms.split(",") if v]:
        waits[0] = StepWaits()
        run = _server_run(model, tokenizer, wl, args.clients, options, False, interval)
        m = metrics(run)
        print(
            f"server {interval:5.2f} ms/stream {m['output_tok_s']:9,.0f} tok/s  TPOT p50 "
            f"{m['tpot_p50_ms']:6.2f} ms  TTFT p50 {m['ttft_p50_ms']:7.1f} ms  "
            f"({m['output_tok_s'] / base:.2f}x)"
        )
        print("  " + _engine_line(m_off, m)[2:])
        print("  " + waits[0].line())
    if args.engine_process:
        import functools

        from hf_paged_evals.serve_bench import _process_server_run

        from hf_paged.testing import evals_call

        stub = (args.gpu_ms / 1000, args.gpu_us_per_token / 1e6)
        load = functools.partial(evals_call, "profiling.serve_overhead", "stub_model", *stub)
        m = metrics(_process_server_run(load, tokenizer, wl, args.clients, options))
        print(
            f"engine process          {m['output_tok_s']:9,.0f} tok/s  TPOT p50 "
            f"{m['tpot_p50_ms']:6.2f} ms  TTFT p50 {m['ttft_p50_ms']:7.1f} ms  "
            f"({m['output_tok_s'] / base:.2f}x)"
        )
        print("  " + _engine_line(m_off, m)[2:])


if __name__ == "__main__":
    main()
