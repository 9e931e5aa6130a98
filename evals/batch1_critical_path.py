"""What does each kernel of the batch-1 step cost on the critical path? Ablations of one graph.

    python evals/batch1_critical_path.py [layers=22] [ctx=256] [max_model_len=2048] [splits=1]

The small-batch forward's batch-1 launch sequence at the TinyLlama-1.1B shape (bf16, random
weights, every weight distinct; per layer norm_qkv_rope, decode_attention (+ its split reduce),
o + residual, norm + gate/up + SiLU-mul, down + residual; then final norm + lm_head), PDL on, in
one CUDA graph, as evals/batch1_tile_sweep.py builds it. With PDL the kernels overlap, so a
kernel's own duration is not what it costs the step; this bench removes one kernel (or keeps only
the GEMVs) and times what is left: the difference is what that kernel adds to the step. Removing a
kernel feeds its consumer a fixed tensor of the same shape, so the values are meaningless and only
the time is reported. splits=1 then times the whole step again with decode_attention's KV split
count and key-tile width (BLOCK_N) swept. Median of graph replays, L2 flushed before each
(evals/kernels.py bench_graph); the bound is the weight bytes / 4.2 TB/s.
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
from hf_paged.kernels.paged_attention import (  # noqa: E402
    AttentionConfig,
    choose_num_kv_splits,
    decode_config,
)

from hf_paged.forward_context import AttentionMetadata  # noqa: E402

HBM = 4.2e12
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 5632, 32, 4, 64, 32000
PAGE = 16

# what each variant leaves out of every layer (lm_head: of the step)
VARIANTS = {
    "whole step": set(),
    "no attention": {"attention"},
    "attention without splits (no reduce kernel)": {"splits"},
    "no norm_qkv_rope": {"qkv"},
    "no o-projection": {"o"},
    "GEMVs only (o, gate/up, down, lm_head)": {"attention", "qkv"},
    "no lm_head": {"lm_head"},
}


def timed_graph(fn) -> float:
    from hf_paged.testing import load_evals

    load_evals()  # evals/ as the package hf_paged_evals
    return importlib.import_module("hf_paged_evals.kernels").bench_graph(fn) / 1e3


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
    q0 = torch.randn(1, HEADS, HEAD_DIM, device=dev, dtype=bf)
    # the engine's decode graphs fix the split count for max_model_len at capture
    splits = choose_num_kv_splits(1, KV_HEADS, max_model_len, dev)

    def step(drop: set, attn: dict | None = None):
        attn = attn or {}

        def fn():
            h = h0
            for (qkv, o, gate_up, down), (kc, vc) in zip(ws, caches):
                q = q0
                if "qkv" not in drop:
                    q = norm_qkv_rope(
                        h, qkv, None, norm_w, 1e-5, positions, cos, sin, kc, vc,
                        meta.slot_mapping, HEADS, pdl=True,
                    )  # fmt: skip
                a = q
                if "attention" not in drop:
                    a = decode_attention(
                        q, kc, vc, meta, HEAD_DIM**-0.5, pdl=True,
                        num_kv_splits=1 if "splits" in drop else attn.get("splits", splits),
                        config=attn.get("config"),
                    )  # fmt: skip
                if "o" not in drop:
                    h = fused_gemv(a.view(1, -1), o, residual=h, pdl=True)
                act = fused_gemv(
                    h, gate_up[:INTER], up_weight=gate_up[INTER:], norm_weight=norm_w,
                    eps=1e-5, pdl=True,
                )  # fmt: skip
                h = fused_gemv(act, down, residual=h, pdl=True)
            if "lm_head" not in drop:
                fused_gemv(h, lm_head, norm_weight=norm_w, eps=1e-5, pdl=True)

        return fn

    def weight_bytes(drop: set) -> int:
        n = 0
        for qkv, o, gate_up, down in ws:
            for t, site in ((qkv, "qkv"), (o, "o"), (gate_up, None), (down, None)):
                n += 0 if site in drop else t.numel() * 2
        return n + (0 if "lm_head" in drop else lm_head.numel() * 2)

    print(
        f"{torch.cuda.get_device_name()}: TinyLlama-1.1B shape, {layers} layers + lm_head, "
        f"batch 1, bf16, context {ctx}, PDL on; decode_attention with {splits} KV splits "
        f"(the engine's count for max_model_len {max_model_len})",
        flush=True,
    )
    base = None
    for name, drop in VARIANTS.items():
        t = timed_graph(step(drop))
        nbytes = weight_bytes(drop)
        base = t if base is None else base
        print(
            f"  {name}: {t * 1e6:.1f} us/step ({(base - t) * 1e6 / layers:+.2f} us a layer "
            f"saved vs the whole step); weights {nbytes / 1e9:.2f} GB, bound "
            f"{nbytes / HBM * 1e6:.0f} us ({nbytes / HBM / t:.0%})",
            flush=True,
        )
    if opts.get("splits") != "1":
        return
    dec = decode_config(HEADS // KV_HEADS, HEAD_DIM)
    print(f"decode_attention splits x BLOCK_N (default: {splits} x {dec.block_n}):", flush=True)
    for block_n in (64, 128):
        for n in (2, 4, 8, 16, 32):
            cfg = AttentionConfig(dec.block_m, dec.block_q, block_n, dec.num_warps,
                                  dec.num_stages, True)  # fmt: skip
            t = timed_graph(step(set(), dict(splits=n, config=cfg)))
            print(f"  {n} splits x BLOCK_N {block_n}: {t * 1e6:.1f} us/step "
                  f"({(base - t) * 1e6 / layers:+.2f} us a layer)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
