"""Paged attention on an FP8 KV cache against the same values in a bf16 cache.

    python evals/profiling/fp8_attention_bench.py [--sweep]

Llama-3-8B heads (32 q, 8 kv, head_dim 128), block 16, random K/V cast to float8_e4m3fn (scale
1): for decode batches (CUDA-graph replays, L2 flushed), prefill and mixed chunked-prefill +
decode batches (triton's do_bench), the kernel's time on each cache, the KV bytes it streams
per second, and the FP8 / bf16 time ratio. An FP8 cache halves the bytes: a decode step bound
by them should take about half the time. --sweep: FP8-cache tile shapes for decode and prefill
(queries in bf16 and, as an experiment, in fp16: the kernel casts FP8 tiles to the query's
dtype), each against the bf16 cache's default.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch
from bench_setup import bench_graph
from hf_paged.kernels import paged_attention
from hf_paged.kernels.attention_config import (
    AttentionConfig,
    choose_num_kv_splits,
    decode_config,
    prefill_config,
)
from kernel_bench import HKV, HQ, D, paged_batch
from triton.testing import do_bench

FP8 = torch.float8_e4m3fn
SCALE = D**-0.5
G = HQ // HKV
CASES = [  # name, query lengths, sequence lengths, decode-only (graph-timed)
    *[(f"decode {b} x {c}", [1] * b, [c] * b, True) for b in (64, 192, 256) for c in (1024, 4096)],
    ("prefill 2 x 4096", [4096] * 2, [4096] * 2, False),
    ("prefill 1 x 8192", [8192], [8192], False),
    ("4k chunk + 192 decodes at 4k", [4096] + [1] * 192, [4096] + [4096] * 192, False),
    ("2k chunk over 2k + 256 decodes at 4.3k", [2048] + [1] * 256, [4096] + [4300] * 256, False),
]


def time_ms(fn, graph: bool) -> float:
    if graph:
        return bench_graph(fn)
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def attention(query, kc, vc, meta, graph, config=None):
    """A call of paged_attention with a fixed split count for decode (as a CUDA graph fixes it)."""
    splits = None
    if graph and config is not None:
        splits = choose_num_kv_splits(meta.seq_lens.shape[0], HKV, meta.max_seq_len, query.device)
    out = torch.empty_like(query)
    return out, functools.partial(
        paged_attention, query, kc, vc, meta, SCALE, out=out, config=config, num_kv_splits=splits
    )


def compare() -> None:
    print("| batch | bf16 cache ms | TB/s | FP8 cache ms | TB/s | FP8 / bf16 time | rel err |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, q_lens, seq_lens, graph in CASES:
        query, kc, vc, meta = paged_batch(q_lens, seq_lens)
        kv_elems = sum(seq_lens) * HKV * D * 2
        _, fn = attention(query, kc, vc, meta, graph)
        ms_bf16 = time_ms(fn, graph)
        kc8, vc8 = kc.to(FP8), vc.to(FP8)
        out8, fn8 = attention(query, kc8, vc8, meta, graph)
        ms_fp8 = time_ms(fn8, graph)
        # against the bf16 cache holding the FP8-rounded values: the kernel's error alone
        ref = paged_attention(query, kc8.to(kc.dtype), vc8.to(vc.dtype), meta, SCALE)
        fn8()
        err = ((out8.float() - ref.float()).norm() / ref.float().norm()).item()
        print(
            f"| {name} | {ms_bf16:.3f} | {kv_elems * 2 / ms_bf16 / 1e9:.2f} | {ms_fp8:.3f} | "
            f"{kv_elems / ms_fp8 / 1e9:.2f} | {ms_fp8 / ms_bf16:.2f} | {err:.1e} |",
            flush=True,
        )
        del query, kc, vc, kc8, vc8, out8, ref
        torch.cuda.empty_cache()


def sweep() -> None:
    dec = decode_config(G, D)
    pre = prefill_config(G, D, torch.bfloat16)
    decode_tiles = [
        AttentionConfig(dec.block_m, dec.block_q, bn, w, s, True)
        for bn, w, s in itertools.product((128, 256), (4, 8), (2, 3, 4))
    ]
    prefill_tiles = [
        AttentionConfig(bm, bm // G, bn, w, s, False)
        for bm, bn, w, s in (
            (128, 128, 8, 2),
            (128, 128, 8, 3),
            (128, 64, 8, 3),
            (128, 64, 4, 3),
            (256, 64, 8, 2),
            (128, 128, 4, 2),
        )
    ]
    sweeps = [
        ("decode 256 x 4096", [1] * 256, [4096] * 256, True, decode_tiles),
        ("decode 64 x 4096", [1] * 64, [4096] * 64, True, decode_tiles[::3]),
        ("prefill 2 x 4096", [4096] * 2, [4096] * 2, False, prefill_tiles),
    ]
    print(f"\nFP8-cache tiles (default decode {dec}, prefill {pre})")
    print("| batch | tile (block_m, block_n, warps, stages) | query | ms | / bf16 cache default |")
    print("| --- | --- | --- | ---: | ---: |")
    for name, q_lens, seq_lens, graph, tiles in sweeps:
        query, kc, vc, meta = paged_batch(q_lens, seq_lens)
        base = time_ms(attention(query, kc, vc, meta, graph)[1], graph)
        kc8, vc8 = kc.to(FP8), vc.to(FP8)
        for tile, qd in itertools.product([None, *tiles], (torch.bfloat16, torch.float16)):
            fn = attention(query.to(qd), kc8, vc8, meta, graph, tile)[1]
            ms = time_ms(fn, graph)
            shape = "default"
            if tile is not None:
                shape = f"{tile.block_m}, {tile.block_n}, {tile.num_warps}, {tile.num_stages}"
            print(f"| {name} | {shape} | {str(qd)[6:]} | {ms:.3f} | {ms / base:.2f} |", flush=True)
        del query, kc, vc, kc8, vc8
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep FP8-cache tile shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("evals/profiling/fp8_attention_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"# FP8 KV cache attention, {torch.cuda.get_device_name()}, Llama-3-8B heads\n")
    compare()
    if args.sweep:
        sweep()


if __name__ == "__main__":
    main()
