"""When does each kernel of a batch-1 layer start, get past its wait, and end? Timestamps inside.

    python evals/batch1_trace.py [layers=22] [ctx=384] [max_model_len=2048] [trace_layers=5,11,17]
        [replays=20]

The small-batch forward's batch-1 launch sequence at the TinyLlama-1.1B shape (bf16, random
weights; evals/batch1_problem.py), PDL on, captured in one CUDA graph. In a few layers every
kernel (norm_qkv_rope, decode_attention, its split reduce, the o, gate/up and down GEMVs) writes,
per program, %globaltimer at its start, after its griddepcontrol.wait and at its end
(kernels/trace.py). With PDL the profiler's kernel start is only the first program's; this says
when the programs became resident (start), how long after the previous kernel's last program
ended their wait returned, and how long the work after the wait took. All times are us
relative to the previous kernel's last program end ("prev done"); first / median / last over
the kernel's programs, then the median over replays and traced layers. For decode_attention's
programs with keys, also when their query and first K/V tile had arrived and when that tile was
computed (stamps that wait on the data: a small perturbation). Tracing also raises the residual
GEMVs' registers (o, down: fewer programs a SM than untraced, kernels/trace.py): their times
here are at a lower occupancy than the engine's.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # evals/kernels.py must not shadow the PyPI `kernels` package

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hf_paged.testing import load_evals  # noqa: E402

load_evals()  # evals/ as the package hf_paged_evals
P = importlib.import_module("hf_paged_evals.batch1_problem")
trace = importlib.import_module("hf_paged.kernels.trace")

KERNELS = ("norm_qkv_rope", "decode_attention", "split reduce", "o", "gate/up", "down")


def main() -> None:
    sizes = ("layers", "ctx", "max_model_len")
    _, p = P.from_argv([a for a in sys.argv[1:] if a.split("=")[0] in sizes])
    extra = dict(a.split("=") for a in sys.argv[1:])
    traced = [int(x) for x in extra.get("trace_layers", "5,11,17").split(",")]
    replays = int(extra.get("replays", 20))
    # one buffer per traced kernel: SLOTS int64 a program (enough for the largest grid)
    bufs = {(layer, k): torch.zeros(trace.SLOTS * 4096, dtype=torch.int64, device="cuda")
            for layer in traced for k in KERNELS}  # fmt: skip

    def arm(i: int) -> None:
        assert not trace._armed, "a traced launch did not take its buffer"
        if i in traced:
            trace.arm(*(bufs[(i, k)] for k in KERNELS))

    def step():
        P.run_step(p, arm)
        arm(-1)  # the last traced layer's buffers were all taken

    for _ in range(2):  # compile
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for b in bufs.values():
        b.zero_()
    rows = {k: [] for k in KERNELS}  # per kernel: [prev-done-relative stats] per replay x layer
    inside = []  # decode_attention's programs with keys: q, K/V, first tile done (relative)
    step_us, grain = [], []
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(replays):
        flush.zero_()  # L2 flushed, as evals/kernels.py bench_graph does
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        step_us.append(start.elapsed_time(end) * 1e3)
        stamps = np.unique(
            torch.cat([b.view(-1, trace.SLOTS)[:, :3].flatten() for b in bufs.values()]).cpu()
        )
        grain.append(np.diff(stamps[stamps > 0]).min() / 1e3)
        for layer in traced:
            prev_done = None
            for k in KERNELS:
                full = bufs[(layer, k)].view(-1, trace.SLOTS).cpu().numpy()
                full = full[full[:, 2] > 0]  # programs that ran
                t = full[:, :3].astype(np.float64) / 1e3  # us
                if prev_done is not None and k == "decode_attention":
                    keyed = full[full[:, 6] == 1][:, [1, 3, 4, 5, 2]].astype(np.float64) / 1e3
                    inside.append(np.median(keyed - prev_done, axis=0))
                if prev_done is not None:
                    rel = t - prev_done
                    rows[k].append([
                        len(t), *np.percentile(rel[:, 0], [0, 50, 100]),
                        *np.percentile(rel[:, 1], [0, 50, 100]),
                        *np.percentile(rel[:, 2], [0, 50, 100]),
                        np.median(rel[:, 2] - rel[:, 1]),
                    ])  # fmt: skip
                prev_done = t[:, 2].max()
        for b in bufs.values():
            b.zero_()
    print(
        f"{torch.cuda.get_device_name()}: TinyLlama-1.1B shape, {p.layer_count} layers + lm_head, "
        f"batch 1, bf16, context {p.ctx}, PDL on, one CUDA graph; whole step "
        f"{np.median(step_us):.1f} us (median of {replays} replays, L2 flushed); traced layers "
        f"{traced}; timer step <= {np.median(grain) * 1e3:.0f} ns (the smallest difference "
        f"between two distinct stamps)",
        flush=True,
    )
    print("  us after the previous kernel's last program ended: first / median / last program")
    print(f"  {'kernel':>17} {'progs':>5}  {'start':>20}  {'wait returns':>20}  {'end':>20}  "
          f"{'end - wait':>10}")  # fmt: skip
    for k in KERNELS[1:]:
        r = np.median(np.array(rows[k]), axis=0)
        f = lambda a, b, c: f"{a:6.2f} {b:6.2f} {c:6.2f}"  # noqa: E731
        print(f"  {k:>17} {r[0]:5.0f}  {f(*r[1:4])}  {f(*r[4:7])}  {f(*r[7:10])}  {r[10]:10.2f}")
    print("  (norm_qkv_rope's own row needs the down projection before it: see the next layer's)")
    w, q, kv, tile, end = np.median(np.array(inside), axis=0)
    print(
        f"  decode_attention's programs with keys (median): wait returns {w:.2f}, query in "
        f"{q:.2f}, first tile's K/V in (or by the query) {kv:.2f}, first tile computed "
        f"{tile:.2f}, end {end:.2f}"
    )


if __name__ == "__main__":
    main()
