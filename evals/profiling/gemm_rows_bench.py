"""The small-batch forward's products at 3-8 rows: the tensor-core kernel (kernels/
fused_gemm_rows.py) against the row-by-row GEMV (kernels/fused_gemv.py) and cuBLAS.

    python evals/profiling/gemm_rows_bench.py [--shape llama-3-8b] [--rows 1,2,3,4,6,8]
        [--sweep ROWS]

For each linear layer of the shape's decoder (fused q/k/v with the norm before it, o with the
residual after it, fused gate/up with norm and SiLU gate, down with the residual), bf16, eight
weight copies a CUDA graph as eight decoder layers follow each other in a step: microseconds a
product and weight bytes streamed per second for the tensor-core kernel (its rule's tile), the
row-by-row kernel (its rule's tile) and torch's F.linear (the product alone, as transformers'
forward runs it: its norm, gate and residual are further kernels, not timed). --sweep ROWS
times a grid of the tensor-core kernel's tiles at ROWS rows instead (the five fastest and the
rule's). Medians of graph replays, L2 flushed before each (bench_setup.bench_graph); bound:
weight bytes / 4.2 TB/s.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from bench_setup import PEAK_BW, bench_graph
from fp8_gemv_bench import COPIES, layer_shapes, weight
from hf_paged.kernels.fused_gemm_rows import fused_gemm_rows, gemm_rows_config
from hf_paged.kernels.fused_gemv import fused_gemv
from hf_paged.kernels.gemv_tiles import tile_config
from hf_paged_evals.roofline import detect_hardware


def _copies(name: str, n: int, k: int):
    """Whether the layer is gated, its output columns, and COPIES bf16 weight copies."""
    gated = name == "gate_up"
    return gated, n // 2 if gated else n, [weight(n, k) for _ in range(COPIES)]


def _calls(name, ws, m, k, n_out):
    """fused_gemv's keyword arguments for each weight copy, as the small-batch forward calls it."""
    gated = name == "gate_up"
    nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16)
    out = []
    for w in ws:
        a = dict(weight=w[:n_out])
        if gated:
            a["up_weight"] = w[n_out:]
        if name in ("qkv", "gate_up"):
            a.update(norm_weight=nw, eps=1e-5)
        else:
            a["residual"] = res
        out.append(a)
    return out


def table(shapes, rows: list[int]) -> None:
    print(f"\nbf16, {COPIES} weight copies a graph: us per product (TB/s)")
    print(
        "| layer | N x K | rows | tensor cores | row by row | F.linear | F.linear / tensor cores "
        "| bound us |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, n, k in shapes:
        gated, n_out, ws = _copies(name, n, k)
        nbytes = n * k * 2
        serial_cfg = tile_config(k, gated, nbytes)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            args = _calls(name, ws, m, k, n_out)
            tc = bench_graph(lambda: [fused_gemm_rows(x, **a, pdl=True) for a in args])
            rs = bench_graph(
                lambda: [fused_gemv(x, **a, pdl=True, config=dict(serial_cfg)) for a in args]
            )
            lin = bench_graph(lambda: [torch.nn.functional.linear(x, w) for w in ws])

            def cell(ms):
                us = ms * 1e3 / COPIES
                return f"{us:.1f} ({nbytes / us / 1e6:.2f})"

            print(
                f"| {name} | {n} x {k} | {m} | {cell(tc)} | {cell(rs)} | {cell(lin)} | "
                f"{lin / tc:.2f}x | {nbytes / PEAK_BW * 1e6:.1f} |",
                flush=True,
            )


def sweep(shapes, m: int) -> None:
    print(f"\ntensor-core tile sweep, {m} rows, {COPIES} weight copies a graph: us per product")
    print("| layer | N x K | rank | BLOCK_N | BLOCK_K | stages | warps | us | TB/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, n, k in shapes:
        gated, n_out, ws = _copies(name, n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        args = _calls(name, ws, m, k, n_out)
        rule = gemm_rows_config(k, gated, name in ("qkv", "gate_up"))
        grid = [
            dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=w)
            for bn, bk, st, w in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 6), (4,))
        ]
        if rule not in grid:
            grid.append(dict(rule))
        results = []
        for cfg in grid:
            try:
                ms = bench_graph(
                    lambda: [fused_gemm_rows(x, **a, pdl=True, config=dict(cfg)) for a in args]
                )
            except Exception as e:  # a tile that does not fit (shared memory, registers)
                print(f"<!-- {name} {cfg}: {type(e).__name__} -->")
                continue
            results.append((ms * 1e3 / COPIES, cfg))
        results.sort(key=lambda r: r[0])
        for i, (us, cfg) in enumerate(results):
            if i < 5 or cfg == rule:
                rank = f"{i + 1}" + (" (rule)" if cfg == rule else "")
                print(
                    f"| {name} | {n} x {k} | {rank} | {cfg['BLOCK_N']} | {cfg['BLOCK_K']} | "
                    f"{cfg['num_stages']} | {cfg['num_warps']} | {us:.1f} | "
                    f"{n * k * 2 / us / 1e6:.2f} |",
                    flush=True,
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--sweep", type=int, default=0, help="sweep the tiles at this many rows")
    args = ap.parse_args()
    shapes = layer_shapes(args.shape)
    print(f"{args.shape} decoder products, {detect_hardware(torch.device('cuda')).name}")
    if args.sweep:
        sweep(shapes, args.sweep)
    else:
        table(shapes, [int(r) for r in args.rows.split(",")])


if __name__ == "__main__":
    main()
