"""FP8 weight products (hf_paged/quantization/fp8_weights.py) against the bf16 ones they replace.

    python evals/profiling/fp8_gemv_bench.py [--shape llama-3-8b] [--small-rows 1,2]
        [--rows 4,8,16] [--gemm-rows 256,1024,4096] [--gemv-sweep ROWS]

For each linear layer of the shape's decoder (fused q/k/v, o, fused gate/up, down), three
tables, each FP8 product against its bf16 counterpart on the same rows:

- small-batch forward (--small-rows, batch-1/2 decode): the fused GEMV (kernels/fused_gemv.py)
  as that forward runs it (norm before q/k/v and gate/up, SiLU gate, residual after o and
  down) on FP8 weights with their 1x128 block scales, against the same kernel on bf16 weights.
  Eight copies of the layer's weights in one CUDA graph, as eight decoder layers follow each
  other in a step (one copy's launch tail would otherwise be a large part of a 6 us product);
  microseconds per product and the weight bytes streamed per second.
- FP8 GEMV (--rows, steps of 3-16 tokens): kernels/fp8_gemv.py against torch's bf16 F.linear,
  eight weight copies a graph as above. --gemv-sweep ROWS times a grid of its tiles instead
  (the measurement behind kernels/fp8_gemv.py's gemv_config).
- GEMM (--gemm-rows, prefill and large batches): the engine's product, activations quantised
  per token and 128 columns then torch's blockwise scaled_mm (1x128 x 1x128), against bf16
  F.linear, and torch's rowwise scaled_mm (a scale per token x one per output channel: the
  faster kind, which per-channel weight scales would allow; product only). TFLOP/s.

Times are medians of CUDA-graph replays, L2 flushed before each (bench_setup.bench_graph);
bounds: weight bytes / 4.2 TB/s, FLOPs / 775 TFLOP/s.
"""

from __future__ import annotations

import argparse

import torch
from bench_setup import PEAK_BW, PEAK_FLOPS, bench_graph, models
from hf_paged.kernels.attention_config import num_sms
from hf_paged.kernels.fp8_gemv import fp8_gemv, gemv_config
from hf_paged.kernels.fused_gemv import fused_gemv

from hf_paged.quantization.fp8_weights import _blockwise_scaled_mm, quantize_weight

COPIES = 8  # weight copies a graph runs in turn (small-batch table)


def layer_shapes(shape: str) -> list[tuple[str, int, int]]:
    cfg = models.SHAPES[shape]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    return [("qkv", h + 2 * kv, h), ("o", h, h), ("gate_up", 2 * inter, h), ("down", h, inter)]


def weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02


def small_batch_table(shapes, rows: list[int]) -> None:
    print(f"\nsmall-batch forward's fused GEMV, {COPIES} weight copies a graph: us per product")
    print("| layer | N x K | rows | fp8 us | fp8 TB/s | bf16 us | bf16 TB/s | bf16 / fp8 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, n, k in shapes:
        gated = name == "gate_up"
        n_out = n // 2 if gated else n
        norm = name in ("qkv", "gate_up")
        bf16 = [weight(n, k) for _ in range(COPIES)]
        fp8 = [quantize_weight(w) for w in bf16]
        nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16)

            def calls(ws, scaled):  # fused_gemv's arguments for each copy
                out = []
                for w in ws:
                    w8, s = w if scaled else (w, None)
                    a = dict(weight=w8[:n_out], weight_scale=None if s is None else s[:n_out])
                    if gated:
                        a.update(up_weight=w8[n_out:], up_scale=None if s is None else s[n_out:])
                    if norm:
                        a.update(norm_weight=nw, eps=1e-5)
                    else:
                        a.update(residual=res)
                    out.append(a)
                return out

            def run(args):
                for a in args:
                    fused_gemv(x, **a)

            fp8_us = bench_graph(lambda: run(calls(fp8, True))) * 1e3 / COPIES
            bf16_us = bench_graph(lambda: run(calls(bf16, False))) * 1e3 / COPIES
            fp8_bytes = fp8[0][0].numel() + fp8[0][1].numel() * 4
            bf16_bytes = bf16[0].numel() * 2
            print(
                f"| {name} | {n} x {k} | {m} | {fp8_us:.1f} | {fp8_bytes / fp8_us / 1e6:.2f} | "
                f"{bf16_us:.1f} | {bf16_bytes / bf16_us / 1e6:.2f} | {bf16_us / fp8_us:.2f}x |",
                flush=True,
            )


def gemv_table(shapes, rows: list[int]) -> None:
    print(
        f"\nFP8 GEMV (kernels/fp8_gemv.py, gemv_config's tile) against bf16 F.linear, {COPIES} "
        "weight copies a graph: us per product"
    )
    print(
        "| layer | N x K | rows | fp8 us | fp8 TB/s | bf16 us | bf16 TB/s | bf16 / fp8 | bound us |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, n, k in shapes:
        bf16 = [weight(n, k) for _ in range(COPIES)]
        fp8 = [quantize_weight(w) for w in bf16]
        fp8_bytes = fp8[0][0].numel() + fp8[0][1].numel() * 4
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fp8_us = bench_graph(lambda: [fp8_gemv(x, w8, s) for w8, s in fp8]) * 1e3 / COPIES
            bf16_us = (
                bench_graph(lambda: [torch.nn.functional.linear(x, w) for w in bf16]) * 1e3 / COPIES
            )
            print(
                f"| {name} | {n} x {k} | {m} | {fp8_us:.1f} | {fp8_bytes / fp8_us / 1e6:.2f} | "
                f"{bf16_us:.1f} | {n * k * 2 / bf16_us / 1e6:.2f} | {bf16_us / fp8_us:.2f}x | "
                f"{fp8_bytes / PEAK_BW * 1e6:.1f} |",
                flush=True,
            )


def gemm_table(shapes, rows: list[int]) -> None:
    print("\nGEMM: TFLOP/s (ratio to bf16 F.linear)")
    print("| layer | N x K | rows | bf16 | engine blockwise (with activation quant) | rowwise |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, n, k in shapes:
        w = weight(n, k)
        w8, scale = quantize_weight(w)
        # rowwise: one scale per output channel, one per token
        w_scale = w.float().abs().amax(dim=1, keepdim=True).t() / 448.0  # [1, N]
        w8_row = (w.float() / w_scale.t()).to(torch.float8_e4m3fn)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_scale = x.float().abs().amax(dim=1, keepdim=True) / 448.0  # [M, 1]
            x8 = (x.float() / x_scale).to(torch.float8_e4m3fn)
            flops = 2 * m * n * k
            bf16_ms = bench_graph(lambda: torch.nn.functional.linear(x, w))
            block_ms = bench_graph(lambda: _blockwise_scaled_mm(x, w8, scale, None))
            row_ms = bench_graph(
                lambda: torch._scaled_mm(x8, w8_row.t(), x_scale, w_scale, out_dtype=torch.bfloat16)
            )

            def tf(ms):
                return flops / (ms * 1e-3) / 1e12

            print(
                f"| {name} | {n} x {k} | {m} | {tf(bf16_ms):.0f} | {tf(block_ms):.0f} "
                f"({bf16_ms / block_ms:.2f}x) | {tf(row_ms):.0f} ({bf16_ms / row_ms:.2f}x) |",
                flush=True,
            )
    print(f"(bound: {PEAK_FLOPS / 1e12:.0f} TFLOP/s bf16; FP8 tensor cores are twice that)")


def gemv_sweep(shapes, rows: int) -> None:
    """Every tile of a grid for kernels/fp8_gemv.py at `rows` rows, COPIES weight copies a
    graph: the five fastest per layer and the rule's (gemv_config)."""
    import itertools

    print(f"\nFP8 GEMV tile sweep, {rows} rows, {COPIES} weight copies a graph: us per product")
    print("| layer | N x K | rank | BLOCK_N | splits | warps | stages | us | TB/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    sms = num_sms(torch.device("cuda"))
    for name, n, k in shapes:
        copies = [quantize_weight(weight(n, k)) for _ in range(COPIES)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        nbytes = copies[0][0].numel() + copies[0][1].numel() * 4
        rule = gemv_config(n, k, sms)
        grid = [
            dict(BLOCK_N=bn, splits=sp, num_warps=w, num_stages=st)
            for bn, sp, w, st in itertools.product(
                (16, 32, 64, 128), (1, 2, 4, 8, 16), (4, 8), (3, 4, 6)
            )
        ]
        if rule not in grid:
            grid.append(rule)
        results = []
        for cfg in grid:
            try:
                us = bench_graph(lambda: [fp8_gemv(x, w8, s, config=cfg) for w8, s in copies])
            except Exception as e:  # a tile that does not fit (shared memory, registers)
                print(f"<!-- {name} {cfg}: {type(e).__name__} -->")
                continue
            results.append((us * 1e3 / COPIES, cfg))
        results.sort(key=lambda r: r[0])
        for i, (us, cfg) in enumerate(results):
            if i < 5 or cfg == rule:
                rank = f"{i + 1}" + (" (rule)" if cfg == rule else "")
                print(
                    f"| {name} | {n} x {k} | {rank} | {cfg['BLOCK_N']} | {cfg['splits']} | "
                    f"{cfg['num_warps']} | {cfg['num_stages']} | {us:.1f} | "
                    f"{nbytes / us / 1e6:.2f} |",
                    flush=True,
                )
        best = results[0][1]
        for dot_fp16 in (True, False):
            us = bench_graph(
                lambda: [
                    fp8_gemv(x, w8, s, config=dict(best, dot_fp16=dot_fp16)) for w8, s in copies
                ]
            )
            print(
                f"<!-- {name} best tile, dot in {'fp16' if dot_fp16 else 'bf16'}: "
                f"{us * 1e3 / COPIES:.1f} us -->"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b", choices=tuple(models.SHAPES))
    parser.add_argument("--small-rows", default="1,2")
    parser.add_argument("--rows", default="4,8,16")
    parser.add_argument("--gemm-rows", default="256,1024,4096")
    parser.add_argument("--gemv-sweep", type=int, default=0, metavar="ROWS")
    args = parser.parse_args()
    shapes = layer_shapes(args.shape)
    print(f"{args.shape} on {torch.cuda.get_device_name()}")

    def ints(s):
        return [int(r) for r in s.split(",") if r]

    if args.gemv_sweep:
        gemv_sweep(shapes, args.gemv_sweep)
    if ints(args.small_rows):
        small_batch_table(shapes, ints(args.small_rows))
    if ints(args.rows):
        gemv_table(shapes, ints(args.rows))
    if ints(args.gemm_rows):
        gemm_table(shapes, ints(args.gemm_rows))


if __name__ == "__main__":
    main()
