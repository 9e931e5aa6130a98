"""Benchmark of hf_paged's Triton attention kernels on a GPU.

    python evals/profiling/kernel_bench.py [--quick] [--sweep] [--out FILE]

Prints markdown tables and (with --out) writes the numbers as JSON.

- Copy bandwidth: a large device-to-device copy (bytes read + written), measured in this run.
- Decode: Llama-3-8B attention shapes (32 q heads, 8 kv heads, head_dim 128), bf16, block 16,
  batch x context. Achieved KV bandwidth = KV bytes read / time, against the copy bandwidth, and
  against torch SDPA on the same K/V gathered from the paged cache into contiguous tensors
  (gather time counted: that is what a non-paged kernel would have to do).
- Prefill: 1k-16k new tokens (one sequence, and a few), TFLOP/s against torch SDPA's flash
  backend on contiguous tensors.
- --sweep: tile-shape and split-count sweeps used to pick the defaults in
  kernels/attention_config.py (select_config / choose_num_kv_splits).

Decode and write_kv are timed as CUDA-graph replays (how the engine runs decode; keeps Python
launch overhead out of kernel-vs-kernel ratios), L2 flushed before each; prefill and mixed
batches with triton.testing.do_bench (eager, CUDA events, L2 flushed). Medians throughout.
Bounds use the H200's ceilings (bench_setup.py): 4.2 TB/s and 775 TFLOP/s (bf16). Results:
evals/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sys

import torch
import torch.nn.functional as F
import triton
from bench_setup import PEAK_BW, PEAK_FLOPS, bench_graph
from hf_paged.kernels import paged_attention, write_kv
from hf_paged.kernels.attention_config import AttentionConfig, choose_num_kv_splits
from triton.testing import do_bench

from hf_paged.worker.forward_context import AttentionMetadata

HQ, HKV, D, BLOCK = 32, 8, 128, 16  # Llama-3-8B attention
DTYPE = torch.bfloat16
WARMUP_MS, REP_MS = 10, 60


def bench(fn) -> float:
    """Median milliseconds of eager calls (host launch overhead included when it dominates)."""
    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


def copy_bandwidth() -> dict:
    n = 2 * 1024**3 // 2  # 2 GiB of bf16 each way
    src = torch.randn(n, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = bench(functools.partial(dst.copy_, src))
    bw = 2 * src.numel() * src.element_size() / (ms * 1e-3)
    return {"bytes": 2 * n * 2, "ms": ms, "bw": bw}


# ---- batches ----------------------------------------------------------------------------------


def paged_batch(q_lens: list[int], seq_lens: list[int], num_blocks_extra: int = 0, seed: int = 0):
    """Random query and a paged cache with every sequence's context at shuffled blocks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [math.ceil(s / BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + num_blocks_extra
    key_cache = torch.randn(num_blocks, BLOCK, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    value_cache = torch.randn_like(key_cache)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).int()
    max_blocks = max(blocks_per_seq)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device="cuda")
    pos = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[pos : pos + n]
        pos += n
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, HQ, D, device="cuda", dtype=DTYPE, generator=g)
    meta = AttentionMetadata.from_lengths(q_lens, seq_lens, block_table)
    return query, key_cache, value_cache, meta


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, Hkv, ctx, D] contiguous copy of each sequence's context (all of length ctx)."""
    b = block_table.shape[0]
    flat = cache[block_table.long()].view(b, -1, HKV, D)[:, :ctx]
    return flat.transpose(1, 2).contiguous()


# ---- decode -----------------------------------------------------------------------------------


def run_decode(batches, contexts, copy_bw: float) -> list[dict]:
    rows = []
    scale = D**-0.5
    for batch in batches:
        for ctx in contexts:
            kv_bytes = 2 * batch * ctx * HKV * D * 2
            # paged cache + gathered copy for the baseline + headroom
            if 2.6 * kv_bytes > free_bytes():
                rows.append({"batch": batch, "ctx": ctx, "skipped": "memory"})
                continue
            query, kc, vc, meta = paged_batch([1] * batch, [ctx] * batch)
            out = torch.empty_like(query)
            splits = choose_num_kv_splits(batch, HKV, ctx, query.device)
            ours = functools.partial(paged_attention, query, kc, vc, meta, scale, out=out)
            ms = bench_graph(ours)
            ms_eager = bench(ours)

            # Baseline: gather the pages into contiguous K/V, then SDPA. With one query token
            # the G query heads of a kv head are just G query rows (no mask): [B, Hkv, G, D].
            q4 = query.view(batch, HKV, HQ // HKV, D)

            def gathered_sdpa(q4=q4, kc=kc, vc=vc, block_table=meta.block_table, ctx=ctx):
                k = gather_kv(kc, block_table, ctx)
                v = gather_kv(vc, block_table, ctx)
                return F.scaled_dot_product_attention(q4, k, v, scale=scale)

            ref = gathered_sdpa().reshape(batch, HQ, D)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms_base = bench_graph(gathered_sdpa)
            k = gather_kv(kc, meta.block_table, ctx)
            v = gather_kv(vc, meta.block_table, ctx)
            ms_sdpa = bench_graph(
                functools.partial(F.scaled_dot_product_attention, q4, k, v, scale=scale)
            )
            del k, v, kc, vc, query, out, q4, gathered_sdpa
            torch.cuda.empty_cache()
            bw = kv_bytes / (ms * 1e-3)
            rows.append(
                {
                    "batch": batch,
                    "ctx": ctx,
                    "splits": splits,
                    "kv_bytes": kv_bytes,
                    "ms": ms,
                    "ms_eager": ms_eager,
                    "bw": bw,
                    "pct_copy": bw / copy_bw,
                    "ms_gathered_sdpa": ms_base,
                    "ms_sdpa_only": ms_sdpa,
                    "speedup_vs_gathered": ms_base / ms,
                    "bound_ms": kv_bytes / PEAK_BW * 1e3,
                    "rel_err": err,
                }
            )
    return rows


def print_decode(rows: list[dict]) -> None:
    print("\n## Decode (Llama-3-8B heads 32q/8kv/128, bf16, block 16, one token per sequence)\n")
    print(
        "Times are CUDA-graph replays (as the engine runs decode), L2 flushed before each; "
        "'eager' is one plain call from Python (launch overhead included).\n"
    )
    print(
        "| batch | context | splits | KV MB | ours ms | KV GB/s | % of copy | gathered SDPA ms "
        "| ours vs gathered | SDPA-only ms | bound ms | ours eager ms | rel err |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['batch']} | {r['ctx']} | skipped ({r['skipped']}) ||||||||||||")
            continue
        print(
            f"| {r['batch']} | {r['ctx']} | {r['splits']} | {r['kv_bytes'] / 1e6:.0f} | "
            f"{r['ms']:.4f} | {r['bw'] / 1e9:.0f} | {100 * r['pct_copy']:.0f}% | "
            f"{r['ms_gathered_sdpa']:.4f} | {r['speedup_vs_gathered']:.2f}x | "
            f"{r['ms_sdpa_only']:.4f} | {r['bound_ms']:.4f} | {r['ms_eager']:.4f} | "
            f"{r['rel_err']:.1e} |"
        )


# ---- prefill ----------------------------------------------------------------------------------


def causal_flops(seq_lens: list[int], q_lens: list[int]) -> float:
    # 2 matmuls x 2 FLOPs per MAC x heads x D x (visible (query, key) pairs)
    pairs = 0
    for s, q in zip(seq_lens, q_lens):
        ctx = s - q
        pairs += q * ctx + q * (q + 1) // 2
    return 4.0 * HQ * D * pairs


def flash_sdpa(q, k, v, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def run_prefill(cases: list[tuple[int, int]]) -> list[dict]:
    rows = []
    scale = D**-0.5
    for num_seqs, seq_len in cases:
        q_lens = [seq_len] * num_seqs
        query, kc, vc, meta = paged_batch(q_lens, q_lens)
        out = torch.empty_like(query)
        ms = bench(functools.partial(paged_attention, query, kc, vc, meta, scale, out=out))
        flops = causal_flops(q_lens, q_lens)
        # Baseline: flash SDPA on the same K/V, contiguous [B, H, S, D] (layout not timed).
        q_b = query.view(num_seqs, seq_len, HQ, D).transpose(1, 2)
        k_b = gather_kv(kc, meta.block_table, seq_len)
        v_b = gather_kv(vc, meta.block_table, seq_len)
        gqa = "enable_gqa"
        try:
            ref = flash_sdpa(q_b, k_b, v_b, scale)
        except RuntimeError:
            # flash without GQA support: expand K/V heads outside the timed region
            gqa = "repeat_interleave"
            k_b = k_b.repeat_interleave(HQ // HKV, 1)
            v_b = v_b.repeat_interleave(HQ // HKV, 1)
            ref = flash_sdpa(q_b, k_b, v_b, scale)
        ref = ref.transpose(1, 2).reshape(-1, HQ, D)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        ms_base = bench(functools.partial(flash_sdpa, q_b, k_b, v_b, scale))
        rows.append(
            {
                "num_seqs": num_seqs,
                "seq_len": seq_len,
                "flops": flops,
                "ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12,
                "ms_flash": ms_base,
                "tflops_flash": flops / (ms_base * 1e-3) / 1e12,
                "ratio_vs_flash": ms_base / ms,
                "bound_ms": flops / PEAK_FLOPS * 1e3,
                "rel_err": err,
                "baseline_gqa": gqa,
            }
        )
        del query, kc, vc, out, q_b, k_b, v_b
        torch.cuda.empty_cache()
    return rows


def print_prefill(rows: list[dict]) -> None:
    print("\n## Prefill (causal, no cached prefix; Llama-3-8B heads, bf16, block 16)\n")
    print(
        "| seqs x new tokens | ours ms | ours TFLOP/s | flash SDPA ms | flash TFLOP/s "
        "| ours / flash (speed) | bound ms | rel err |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['num_seqs']} x {r['seq_len']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
            f"{r['ms_flash']:.3f} | {r['tflops_flash']:.0f} | {r['ratio_vs_flash']:.2f} | "
            f"{r['bound_ms']:.3f} | {r['rel_err']:.1e} |"
        )


def run_mixed() -> list[dict]:
    """Chunked prefill over a cached prefix plus decodes in one call (no baseline: SDPA has no
    bottom-right causal mask over a prefix in its flash path)."""
    rows = []
    scale = D**-0.5
    cases = [
        ("2k chunk over 6k prefix", [2048], [8192]),
        ("2k chunk over 6k prefix + 64 decodes at 4k", [2048] + [1] * 64, [8192] + [4096] * 64),
        (
            "4 x 512-token chunks over 2k + 128 decodes at 2k",
            [512] * 4 + [1] * 128,
            [2560] * 4 + [2048] * 128,
        ),
    ]
    for name, q_lens, seq_lens in cases:
        query, kc, vc, meta = paged_batch(q_lens, seq_lens)
        out = torch.empty_like(query)
        ms = bench(functools.partial(paged_attention, query, kc, vc, meta, scale, out=out))
        flops = causal_flops(seq_lens, q_lens)
        kv_bytes = sum(seq_lens) * HKV * D * 2 * 2
        rows.append(
            {
                "case": name,
                "ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12,
                "kv_bytes": kv_bytes,
                "bound_ms": max(flops / PEAK_FLOPS, kv_bytes / PEAK_BW) * 1e3,
            }
        )
        del query, kc, vc, out
        torch.cuda.empty_cache()
    return rows


def print_mixed(rows: list[dict]) -> None:
    print("\n## Mixed batches (one call)\n")
    print("| batch | ours ms | TFLOP/s | bound ms |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['bound_ms']:.3f} |")


def run_write_kv() -> list[dict]:
    rows = []
    for num_tokens in (256, 8192):
        g = torch.Generator(device="cuda").manual_seed(0)
        num_blocks = 4 * num_tokens // BLOCK
        kc = torch.empty(num_blocks, BLOCK, HKV, D, device="cuda", dtype=DTYPE)
        vc = torch.empty_like(kc)
        key = torch.randn(num_tokens, HKV, D, device="cuda", dtype=DTYPE, generator=g)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * BLOCK, device="cuda", generator=g)[:num_tokens]
        ms = bench_graph(functools.partial(write_kv, key, value, kc, vc, slots))
        nbytes = 2 * 2 * key.numel() * key.element_size()  # read + write, K and V
        rows.append({"num_tokens": num_tokens, "ms": ms, "bw": nbytes / (ms * 1e-3)})
    return rows


def print_write_kv(rows: list[dict]) -> None:
    print("\n## write_kv (8 kv heads x 128, bf16, random slots; CUDA-graph replay)\n")
    print("| tokens | ms | GB/s (read + write) |")
    print("|---:|---:|---:|")
    for r in rows:
        print(f"| {r['num_tokens']} | {r['ms']:.4f} | {r['bw'] / 1e9:.0f} |")


# ---- sweeps (tuning) --------------------------------------------------------------------------


def run_sweeps() -> dict:
    scale = D**-0.5
    res: dict = {"decode_tiles": [], "decode_splits": [], "prefill_tiles": []}
    g = HQ // HKV
    for batch, ctx in ((64, 2048), (64, 8192)):
        query, kc, vc, meta = paged_batch([1] * batch, [ctx] * batch)
        out = torch.empty_like(query)
        for bn, warps, stages in ((64, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 3)):
            cfg = AttentionConfig(16, 16 // g, bn, warps, stages, one_tile_per_seq=True)
            try:
                ms = bench_graph(
                    functools.partial(
                        paged_attention,
                        query,
                        kc,
                        vc,
                        meta,
                        scale,
                        out=out,
                        config=cfg,
                        num_kv_splits=1,
                    )
                )
            except Exception as e:  # noqa: BLE001 (out of resources etc.: record and go on)
                ms = float("nan")
                print(f"decode cfg {cfg} failed: {e}", file=sys.stderr)
            res["decode_tiles"].append(
                {
                    "batch": batch,
                    "ctx": ctx,
                    "block_n": bn,
                    "warps": warps,
                    "stages": stages,
                    "ms": ms,
                    "gbps": 2 * batch * ctx * HKV * D * 2 / ms / 1e6,
                }
            )
        del query, kc, vc, out
    for batch, ctx in ((1, 8192), (1, 32768), (16, 2048), (16, 8192), (64, 2048), (64, 8192)):
        query, kc, vc, meta = paged_batch([1] * batch, [ctx] * batch)
        out = torch.empty_like(query)
        for splits in (1, 2, 4, 8, 16, 32):
            ms = bench_graph(
                functools.partial(
                    paged_attention, query, kc, vc, meta, scale, out=out, num_kv_splits=splits
                )
            )
            res["decode_splits"].append(
                {
                    "batch": batch,
                    "ctx": ctx,
                    "splits": splits,
                    "ms": ms,
                    "gbps": 2 * batch * ctx * HKV * D * 2 / ms / 1e6,
                    "default": choose_num_kv_splits(batch, HKV, ctx, query.device),
                }
            )
        del query, kc, vc, out
    seq_len = 8192
    query, kc, vc, meta = paged_batch([seq_len], [seq_len])
    out = torch.empty_like(query)
    flops = causal_flops([seq_len], [seq_len])
    for bm, bn, warps, stages in (
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (64, 128, 4, 2),
    ):
        cfg = AttentionConfig(bm, bm // g, bn, warps, stages, one_tile_per_seq=False)
        try:
            ms = bench(
                functools.partial(paged_attention, query, kc, vc, meta, scale, out=out, config=cfg)
            )
        except Exception as e:  # noqa: BLE001
            ms = float("nan")
            print(f"prefill cfg {cfg} failed: {e}", file=sys.stderr)
        res["prefill_tiles"].append(
            {
                "seq_len": seq_len,
                "block_m": bm,
                "block_n": bn,
                "warps": warps,
                "stages": stages,
                "ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12,
            }
        )
    return res


def print_sweeps(res: dict) -> None:
    print("\n## Sweep: decode tiles (splits = 1, CUDA-graph replay)\n")
    print("| batch | ctx | BLOCK_N | warps | stages | ms | GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["decode_tiles"]:
        print(
            f"| {r['batch']} | {r['ctx']} | {r['block_n']} | {r['warps']} | {r['stages']} | "
            f"{r['ms']:.4f} | {r['gbps']:.0f} |"
        )
    print("\n## Sweep: decode KV splits (default tiles, CUDA-graph replay)\n")
    print("| batch | ctx | splits | default | ms | GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in res["decode_splits"]:
        print(
            f"| {r['batch']} | {r['ctx']} | {r['splits']} | {r['default']} | {r['ms']:.4f} | "
            f"{r['gbps']:.0f} |"
        )
    print("\n## Sweep: prefill tiles (1 x 8192)\n")
    print("| BLOCK_M | BLOCK_N | warps | stages | ms | TFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in res["prefill_tiles"]:
        print(
            f"| {r['block_m']} | {r['block_n']} | {r['warps']} | {r['stages']} | "
            f"{r['ms']:.3f} | {r['tflops']:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write all results as JSON here")
    parser.add_argument("--sweep", action="store_true", help="also run the tuning sweeps")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("evals/profiling/kernel_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    hw = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "memory_gb": props.total_memory / 1e9,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    print("# hf_paged kernel benchmark\n")
    print(
        f"Hardware: {hw['gpu']}, {hw['sms']} SMs, {hw['memory_gb']:.0f} GB; torch "
        f"{hw['torch']}, triton {hw['triton']}. Medians (eager: do_bench warmup {WARMUP_MS} "
        f"ms, rep {REP_MS} ms; decode: CUDA-graph replays). Bounds: bytes / "
        f"{PEAK_BW / 1e12:.1f} TB/s, FLOPs / {PEAK_FLOPS / 1e12:.0f} TFLOP/s."
    )
    copy = copy_bandwidth()
    print(
        f"\nCopy bandwidth (this run): {copy['bw'] / 1e12:.2f} TB/s "
        f"({copy['bytes'] / 1e9:.1f} GB moved in {copy['ms']:.3f} ms)"
    )
    results: dict = {"hardware": hw, "copy": copy}
    if args.sweep:
        results["sweeps"] = run_sweeps()
        print_sweeps(results["sweeps"])
    batches = (1, 16, 64, 256)
    contexts = (512, 2048, 8192, 32768)
    if args.quick:
        batches, contexts = (1, 64, 256), (2048, 8192)
    results["decode"] = run_decode(batches, contexts, copy["bw"])
    print_decode(results["decode"])
    prefill_cases = [
        (1, 1024),
        (1, 2048),
        (1, 4096),
        (1, 8192),
        (1, 16384),
        (4, 2048),
        (4, 4096),
        (8, 2048),
    ]
    if args.quick:
        prefill_cases = [(1, 4096), (1, 16384), (4, 4096)]
    results["prefill"] = run_prefill(prefill_cases)
    print_prefill(results["prefill"])
    results["mixed"] = run_mixed()
    print_mixed(results["mixed"])
    results["write_kv"] = run_write_kv()
    print_write_kv(results["write_kv"])
    # targets
    dec = [r for r in results["decode"] if "skipped" not in r]
    tgt_dec = [r for r in dec if r["batch"] >= 64 and r["ctx"] >= 2048]
    print("\n## Targets\n")
    if tgt_dec:
        worst = min(r["pct_copy"] for r in tgt_dec)
        print(
            f"- decode >= 75% of copy bandwidth (batch >= 64, ctx >= 2k): worst "
            f"{100 * worst:.0f}% -> {'met' if worst >= 0.75 else 'NOT met'}"
        )
    slower = [r for r in dec if r["speedup_vs_gathered"] < 1.0]
    print(
        f"- never slower than gathered SDPA: {len(slower)} of {len(dec)} decode shapes slower "
        f"-> {'met' if not slower else 'NOT met'}"
    )
    worst_pf = min(r["ratio_vs_flash"] for r in results["prefill"])
    print(
        f"- prefill >= 50% of flash SDPA: worst {100 * worst_pf:.0f}% -> "
        f"{'met' if worst_pf >= 0.5 else 'NOT met'}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
