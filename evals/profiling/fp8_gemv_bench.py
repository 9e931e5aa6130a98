"""FP8 weight-only GEMV (kernels/fp8_gemv.py) against the bf16 product it replaces.

    python evals/profiling/fp8_gemv_bench.py [--shape llama-3-8b] [--rows 1,2,4,8,16]

For each linear layer of the shape's decoder (fused q/k/v, o, fused gate/up, down) and row
count: the FP8 GEMV's time from CUDA-graph replays (L2 flushed), torch's bf16 F.linear (cuBLAS)
on the same rows, their ratio, and the FP8 weight bytes / 4.2 TB/s bound. At 1-16 rows the
products are bound by the weight bytes they stream: the bound ratio to bf16 is 2x.
"""

from __future__ import annotations

import argparse

import torch
from bench_setup import PEAK_BW, bench_graph, models
from hf_paged.kernels.fp8_gemv import fp8_gemv

from hf_paged.quantization.fp8_weights import quantize_weight


def layer_shapes(shape: str) -> list[tuple[str, int, int]]:
    cfg = models.SHAPES[shape]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    return [("qkv", h + 2 * kv, h), ("o", h, h), ("gate_up", 2 * inter, h), ("down", h, inter)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b", choices=tuple(models.SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{args.shape} on {torch.cuda.get_device_name()}: microseconds per product")
    print("| layer | N x K | rows | fp8 us | bf16 us | bf16 / fp8 | fp8 bound us |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, n, k in layer_shapes(args.shape):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w8, scale = quantize_weight(w)
        bound_us = (w8.numel() + scale.numel() * 4) / PEAK_BW * 1e6
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fp8_ms = bench_graph(lambda: fp8_gemv(x, w8, scale))
            bf16_ms = bench_graph(lambda: torch.nn.functional.linear(x, w))
            print(
                f"| {name} | {n} x {k} | {m} | {fp8_ms * 1e3:.1f} | {bf16_ms * 1e3:.1f} | "
                f"{bf16_ms / fp8_ms:.2f}x | {bound_us:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
