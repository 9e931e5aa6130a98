"""Which tile shapes make the batch-1 layer fastest? A sweep over the small-batch forward's kernels.

    python evals/batch1_tile_sweep.py [layers=22] [ctx=256] [max_model_len=2048]

Times 22 layers of the small-batch forward's launch sequence at the TinyLlama-1.1B shape, bf16,
random weights, one token (norm_qkv_rope, decode_attention over a ctx-token context, o +
residual, norm + gate/up + SiLU-mul, down + residual; then the final norm + lm_head), every
weight distinct (evals/batch1_problem.py), PDL on, captured in one CUDA graph: the engine's
batch-1 step without the embedding and sampling. Each site's launch configuration is swept
while the others keep their defaults (tile_config / qkv_rope_config / decode_config, and
decode_attention's split count for max_model_len, as the engine's graphs use it); the best per
site, then all of them together, are timed against the defaults. Median of graph replays
(evals/kernels.py bench_graph, L2 flushed before each; the session-6 log was timed without the
flush, by a copy of that loop); the bound is the weight bytes / 4.2 TB/s. Session 6 swept the
general paged_attention kernel, which batch-1 decodes took then; they take decode_attention
since.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # evals/kernels.py must not shadow the PyPI `kernels` package

import torch  # noqa: E402
import triton  # noqa: E402
from hf_paged.kernels import decode_attention, fused_gemv, norm_qkv_rope  # noqa: E402
from hf_paged.kernels.paged_attention import AttentionConfig  # noqa: E402

from hf_paged.testing import load_evals  # noqa: E402

load_evals()  # evals/ as the package hf_paged_evals
P = importlib.import_module("hf_paged_evals.batch1_problem")


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
    opts, p = P.from_argv(sys.argv[1:])
    layers, ctx, max_model_len = p.layer_count, p.ctx, p.max_model_len
    hq, d = P.HEADS, P.HEAD_DIM
    meta, dec, splits = p.meta, p.decode, p.splits
    nbytes = p.weight_bytes()

    def step(cfg: dict):
        def fn():
            h, nw, inter = p.h0, p.norm_w, P.INTER
            for (qkv, o, gate_up, down), (kc, vc) in zip(p.layers, p.caches):
                q = norm_qkv_rope(
                    h, qkv, None, nw, 1e-5, p.positions, p.cos, p.sin, kc, vc,
                    meta.slot_mapping, hq, pdl=True, config=cfg.get("qkv_rope"),
                )  # fmt: skip
                a = decode_attention(
                    q, kc, vc, meta, d**-0.5, num_kv_splits=cfg.get("splits"),
                    config=cfg.get("attention"), pdl=True,
                )  # fmt: skip
                h = fused_gemv(a.view(1, -1), o, residual=h, pdl=True, config=cfg.get("o"))
                act = fused_gemv(
                    h, gate_up[:inter], up_weight=gate_up[inter:], norm_weight=nw, eps=1e-5,
                    pdl=True, config=cfg.get("gate_up"),
                )  # fmt: skip
                h = fused_gemv(act, down, residual=h, pdl=True, config=cfg.get("down"))
            fused_gemv(h, p.lm_head, norm_weight=nw, eps=1e-5, pdl=True, config=cfg.get("lm_head"))

        return fn

    print(
        f"{torch.cuda.get_device_name()}: TinyLlama-1.1B shape, {layers} layers + lm_head, "
        f"batch 1, bf16, context {ctx}, {nbytes / 1e9:.2f} GB of weights, "
        f"bound {nbytes / P.HBM * 1e6:.0f} us; "
        f"engine split count for max_model_len {max_model_len}: {splits}",
        flush=True,
    )

    def report(name: str, cfg: dict) -> float | None:
        try:
            t = P.timed_graph(step(cfg))
        except Exception as exc:  # a config that does not compile or launch is a result too
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return None
        print(f"  {name}: {t * 1e6:.1f} us/step ({nbytes / P.HBM / t:.0%} of bound)", flush=True)
        return t

    base = report("defaults", {})
    sites = {
        "qkv_rope": [
            dict(PAIRS=pairs, num_warps=nw)
            for pairs in (1, 2, 4)
            for nw in (2, 4, 8)
            if 2 * pairs * 2048 // (32 * nw) <= 128
        ],
        "o": gemv_candidates(P.HIDDEN, False),
        "gate_up": gemv_candidates(P.HIDDEN, True),
        "down": gemv_candidates(P.INTER, False),
        "lm_head": gemv_candidates(P.HIDDEN, False),
        "splits": [1, 2, 4, 8, 16, 32],
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
