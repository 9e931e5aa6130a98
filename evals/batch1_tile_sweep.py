"""Which tile shapes make the batch-1 layer fastest? A sweep over the small-batch forward's kernels.

    python evals/batch1_tile_sweep.py [layers=22] [ctx=256] [max_model_len=2048]

Times 22 layers of the small-batch forward's launch sequence at the TinyLlama-1.1B shape, bf16,
random weights, one token (norm_qkv_rope, paged attention over a ctx-token context, o + residual,
norm + gate/up + SiLU-mul, down + residual; then the final norm + lm_head), every weight
distinct, PDL on, captured in one CUDA graph: the engine's batch-1 step without the embedding
and sampling. Each site's launch configuration is swept while the others keep their defaults
(tile_config / qkv_rope_config / decode_config and the split count the engine's graphs use, the
one for max_model_len); the best per site, then all of them together, are timed against the
defaults. Median of graph replays (evals/kernels.py bench_graph, L2 flushed before each; the
session-6 log was timed without the flush, by a copy of that loop); the bound is the weight
bytes / 4.2 TB/s.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # evals/kernels.py must not shadow the PyPI `kernels` package

import torch  # noqa: E402
import triton  # noqa: E402
from hf_paged.kernels import fused_gemv, norm_qkv_rope, paged_attention  # noqa: E402
from hf_paged.kernels.paged_attention import (  # noqa: E402
    AttentionConfig,
    choose_num_kv_splits,
    decode_config,
)

from hf_paged.forward_context import AttentionMetadata  # noqa: E402

HBM = 4.2e12
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 5632, 32, 4, 64, 32000
PAGE = 16


def timed_graph(fn) -> float:
    """Seconds per CUDA-graph replay of fn: evals/kernels.py's bench_graph (median, L2 flushed)."""
    from hf_paged.testing import load_evals

    load_evals()  # evals/ as the package hf_paged_evals
    return importlib.import_module("hf_paged_evals.kernels").bench_graph(fn) / 1e3


def gemv_candidates(k: int, gated: bool) -> list[dict]:
    """BLOCK_N x warps whose weight tile is 16-128 elements a thread."""
    k_pad = triton.next_power_of_2(k)
    out = []
    for block_n in (1, 2, 4, 8, 16):
        for warps in (1, 2, 4, 8, 16):
            per_thread = block_n * k_pad * (2 if gated else 1) // (32 * warps)
            if 16 <= per_thread <= 128:
                out.append(dict(BLOCK_N=block_n, num_warps=warps))
    return out


def main() -> None:
    opts = dict(arg.split("=") for arg in sys.argv[1:])
    layers = int(opts.get("layers", 22))
    ctx = int(opts.get("ctx", 256))
    max_model_len = int(opts.get("max_model_len", 2048))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf = torch.bfloat16
    qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM

    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=bf) * 0.02

    ws = [(w(qkv_n, HIDDEN), w(HIDDEN, HIDDEN), w(2 * INTER, HIDDEN), w(HIDDEN, INTER))]
    ws += [tuple(w(*t.shape) for t in ws[0]) for _ in range(layers - 1)]
    lm_head = w(VOCAB, HIDDEN)
    nbytes = sum(t.numel() * 2 for lw in ws for t in lw) + lm_head.numel() * 2
    norm_w = torch.rand(HIDDEN, device=dev, dtype=bf) + 0.5
    half = HEAD_DIM // 2
    pos = torch.arange(max_model_len, device=dev, dtype=torch.float32)[:, None]
    freqs = pos / (10000 ** (torch.arange(half, device=dev) / half))
    cos, sin = freqs.cos().to(bf), freqs.sin().to(bf)
    blocks = triton.cdiv(ctx, PAGE)
    caches = [
        (
            torch.randn(blocks + 1, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=bf),
            torch.randn(blocks + 1, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=bf),
        )
        for _ in range(layers)
    ]
    table = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
    meta = AttentionMetadata.from_lengths([1], [ctx], table)
    meta.slot_mapping.fill_(ctx - 1)
    positions = torch.full((1,), ctx - 1, device=dev, dtype=torch.int64)
    h0 = torch.randn(1, HIDDEN, device=dev, dtype=bf)
    # the engine's decode graphs fix the split count for max_model_len at capture
    splits = choose_num_kv_splits(1, KV_HEADS, max_model_len, dev)
    dec = decode_config(HEADS // KV_HEADS, HEAD_DIM)

    def step(cfg: dict):
        def fn():
            h = h0
            for (qkv, o, gate_up, down), (kc, vc) in zip(ws, caches):
                q = norm_qkv_rope(
                    h, qkv, None, norm_w, 1e-5, positions, cos, sin, kc, vc,
                    meta.slot_mapping, HEADS, pdl=True, config=cfg.get("qkv_rope"),
                )  # fmt: skip
                a = paged_attention(
                    q, kc, vc, meta, HEAD_DIM**-0.5, num_kv_splits=cfg.get("splits", splits),
                    config=cfg.get("attention"), pdl=True,
                )  # fmt: skip
                h = fused_gemv(a.view(1, -1), o, residual=h, pdl=True, config=cfg.get("o"))
                act = fused_gemv(
                    h, gate_up[:INTER], up_weight=gate_up[INTER:], norm_weight=norm_w,
                    eps=1e-5, pdl=True, config=cfg.get("gate_up"),
                )  # fmt: skip
                h = fused_gemv(act, down, residual=h, pdl=True, config=cfg.get("down"))
            fused_gemv(
                h, lm_head, norm_weight=norm_w, eps=1e-5, pdl=True, config=cfg.get("lm_head")
            )

        return fn

    print(
        f"{torch.cuda.get_device_name()}: TinyLlama-1.1B shape, {layers} layers + lm_head, "
        f"batch 1, bf16, context {ctx}, {nbytes / 1e9:.2f} GB of weights, "
        f"bound {nbytes / HBM * 1e6:.0f} us; "
        f"engine split count for max_model_len {max_model_len}: {splits}",
        flush=True,
    )

    def report(name: str, cfg: dict) -> float | None:
        try:
            t = timed_graph(step(cfg))
        except Exception as exc:  # a config that does not compile or launch is a result too
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return None
        print(f"  {name}: {t * 1e6:.1f} us/step ({nbytes / HBM / t:.0%} of bound)", flush=True)
        return t

    base = report("defaults", {})
    sites = {
        "qkv_rope": [
            dict(PAIRS=p, num_warps=nw)
            for p in (1, 2, 4)
            for nw in (2, 4, 8)
            if 2 * p * 2048 // (32 * nw) <= 128
        ],
        "o": gemv_candidates(HIDDEN, False),
        "gate_up": gemv_candidates(HIDDEN, True),
        "down": gemv_candidates(INTER, False),
        "lm_head": gemv_candidates(HIDDEN, False),
        "splits": [1, 2, 4, 8],
        "attention": [
            AttentionConfig(dec.block_m, dec.block_q, bn, nw, st, True)
            for bn in (32, 64, 128)
            for nw in (2, 4)
            for st in (1, 2, 3)
        ],
    }
    best = {}
    for site, cands in sites.items():
        print(f"{site}:", flush=True)
        results = [(report(f"{site}={c}", {site: c}), c) for c in cands]
        results = [(t, c) for t, c in results if t is not None]
        if results:
            t, c = min(results, key=lambda r: r[0])
            if base is not None and t < base:
                best[site] = c
    print(f"best per site: {best}")
    report("defaults again", {})
    report("all best together", best)


if __name__ == "__main__":
    main()
