"""What the OpenAI server costs the engine, on any machine: the offline engine and the server
(uvicorn's event loop and the engine loop thread in one process, the clients in another, as
`run.py serve-bench` runs them) on many short streams, with the model's forward replaced by a
stub that sleeps --gpu-ms without the GIL (a GPU step's wait) and picks a token from the
position, so the token rate is the GPU's and not a CPU forward's.

    python evals/profiling/serve_overhead.py [--clients 256] [--new-tokens 128] [--gpu-ms 2]
        [--stream-interval-ms 0.5,0]

Per run: output tok/s, TPOT p50, the engine's steps and wall time inside step() per step, and
the CPU seconds of the engine loop thread, the event loop thread and the client process. A step
that takes longer in the server than offline is the engine waiting (for the GIL, or on a busy
machine for a core): compare with the threads' CPU seconds. A 2-layer, 64-wide Llama with a
256-token vocabulary stands in for the model.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import time

import torch


def _stub_forward(gpu_s: float, vocab: int):
    def forward(self, model, ids, pos, keep):
        time.sleep(gpu_s)  # releases the GIL, as a wait for the GPU does
        p = pos[keep]
        logits = torch.zeros(p.shape[0], vocab)
        logits[torch.arange(p.shape[0]), p % (vocab - 16) + 8] = 1.0
        return logits

    return forward


def _thread_cpu_s(native_id: int) -> float:
    fields = open(f"/proc/self/task/{native_id}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--gpu-ms", type=float, default=2.0, help="the stub's GIL-free wait per step")
    p.add_argument("--stream-interval-ms", default="0.5,0", help="server runs: a comma list")
    args = p.parse_args(argv)

    import bench_setup  # noqa: F401 (evals/ as the package hf_paged_evals)
    from hf_paged_evals.backends import run_paged
    from hf_paged_evals.serve_bench import _server_run, tiny_model
    from hf_paged_evals.throughput import metrics
    from hf_paged_evals.workloads import Workload, WorkloadRequest

    from hf_paged.entrypoints.async_engine import AsyncEngine
    from hf_paged.entrypoints.server_thread import ServerThread
    from hf_paged.worker.model_forward import ModelForward

    torch.set_num_threads(1)
    model, tokenizer = tiny_model()
    ModelForward._call_model = _stub_forward(args.gpu_ms / 1000, model.config.vocab_size)
    rng = random.Random(0)
    requests = [
        WorkloadRequest([rng.randrange(3, 256) for _ in range(rng.randint(8, 24))], args.new_tokens)
        for _ in range(args.clients)
    ]
    wl = Workload("short", requests, "short prompts", None, {})
    options = {"verify_model": False}  # the stub is not the model the check would compare

    cpu: dict[str, float] = {}
    shutdown, stop = AsyncEngine.shutdown, ServerThread.stop

    def engine_shutdown(self):
        cpu["engine"] = _thread_cpu_s(self._thread.native_id)
        shutdown(self)

    def server_stop(self):
        cpu["loop"] = _thread_cpu_s(self.thread.native_id)
        stop(self)

    AsyncEngine.shutdown, ServerThread.stop = engine_shutdown, server_stop

    off = run_paged(model, wl, args.clients, options, False)
    m = metrics(off)
    base = m["output_tok_s"]
    print(f"{args.clients} streams x {args.new_tokens} tokens, forward stub {args.gpu_ms} ms")
    print(
        f"offline                 {base:9,.0f} tok/s  TPOT p50 {m['tpot_p50_ms']:6.2f} ms  "
        f"{off.extra['num_steps']} steps, {1000 * off.wall_s / off.extra['num_steps']:.2f} ms/step"
    )
    for interval in [float(v) for v in args.stream_interval_ms.split(",") if v]:
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        run = _server_run(model, tokenizer, wl, args.clients, options, False, interval)
        m, x = metrics(run), run.extra
        clients = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - children
        print(
            f"server {interval:5.2f} ms/stream {m['output_tok_s']:9,.0f} tok/s  TPOT p50 "
            f"{m['tpot_p50_ms']:6.2f} ms  {x['num_steps']} steps, "
            f"{1000 * x['step_s'] / x['num_steps']:.2f} ms in step(), {x['num_handoffs']} "
            f"hand-offs  ({m['output_tok_s'] / base:.2f}x)  CPU s: engine {cpu['engine']:.2f} "
            f"loop {cpu['loop']:.2f} clients {clients:.2f}"
        )


if __name__ == "__main__":
    main()
