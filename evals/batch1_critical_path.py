"""What does each kernel of the batch-1 step cost on the critical path? Ablations of one graph.

    python evals/batch1_critical_path.py [layers=22] [ctx=256] [max_model_len=2048] [splits=1]
        [wide=1] [warps=1] [attn=1] [only=WORD]

The small-batch forward's batch-1 launch sequence at the TinyLlama-1.1B shape (bf16, random
weights, every weight distinct; per layer norm_qkv_rope, decode_attention (+ its split reduce),
o + residual, norm + gate/up + SiLU-mul, down + residual; then final norm + lm_head), PDL on, in
one CUDA graph (evals/batch1_problem.py). With PDL the kernels overlap, so a
kernel's own duration is not what it costs the step; this bench removes one kernel (or keeps only
the GEMVs) and times what is left: the difference is what that kernel adds to the step. Removing a
kernel feeds its consumer a fixed tensor of the same shape, so the values are meaningless and only
the time is reported; two variants add an empty PDL kernel a layer instead (what one more kernel
boundary costs). splits=1 then times the whole step again with decode_attention's KV split
count and key-tile width (BLOCK_N) swept; wide=1 with one split whose single key tile holds the
whole context (no reduce kernel); warps=1 with decode_attention's warps (4, 8) and key tile
(64, 128) swept; attn=1 with smaller programs (1-8 warps, 16-128 keys, up to 128 splits;
session 13: all slower than the default 8 x 128 x 16). Median of graph replays, L2 flushed
before each (evals/kernels.py bench_graph); the bound is the weight bytes / 4.2 TB/s. Every
variant is compared with the whole step timed just before and just after it (session 12 saw
the same configuration drift by 25 us over one run; session 13's first run of this interleaving
saw 11 us).
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
from hf_paged.kernels.fused_gemv import gdc_launch_dependents, gdc_wait  # noqa: E402
from hf_paged.kernels.paged_attention import AttentionConfig  # noqa: E402

from hf_paged.testing import load_evals  # noqa: E402

load_evals()  # evals/ as the package hf_paged_evals
P = importlib.import_module("hf_paged_evals.batch1_problem")
DA = importlib.import_module("hf_paged.kernels.decode_attention")  # the module

# what each variant leaves out of every layer (lm_head: of the step)
VARIANTS = {
    "whole step": set(),
    "no attention": {"attention"},
    "attention without splits (no reduce kernel)": {"splits"},
    "no norm_qkv_rope": {"qkv"},
    "no o-projection": {"o"},
    "GEMVs only (o, gate/up, down, lm_head)": {"attention", "qkv"},
    "no lm_head": {"lm_head"},
    # the split reduce alone: decode_attention's partials go to the o-projection unreduced
    "attention without its split reduce kernel": {"reduce"},
    # what a kernel boundary costs: one empty PDL kernel (launch_dependents, wait) a layer
    # after the o-projection, of 1 program and of one a SM
    "+1 empty PDL kernel a layer (1 program)": {"+nop"},
    "+1 empty PDL kernel a layer (a program a SM)": {"+nop", "nop_per_sm"},
}


@triton.jit
def _empty_pdl_kernel():
    gdc_launch_dependents()
    gdc_wait()


def main() -> None:
    opts, p = P.from_argv(sys.argv[1:])
    layers, ctx, max_model_len = p.layer_count, p.ctx, p.max_model_len
    hq, d = P.HEADS, P.HEAD_DIM
    meta, dec, splits = p.meta, p.decode, p.splits
    q0 = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)

    def step(drop: set, attn: dict | None = None):
        attn = attn or {}

        nop_grid = (torch.cuda.get_device_properties(0).multi_processor_count,)
        if "nop_per_sm" not in drop:
            nop_grid = (1,)

        def gemv(x, w, **kw):
            return fused_gemv(x, w, pdl=True, **kw)

        def fn():
            reduce = DA._reduce_splits
            if "reduce" in drop:
                DA._reduce_splits = lambda *args: None  # the partials stay unreduced
            try:
                layers_and_head()
            finally:
                DA._reduce_splits = reduce

        def layers_and_head():
            h, nw, inter = p.h0, p.norm_w, P.INTER
            for (qkv, o, gate_up, down), (kc, vc) in zip(p.layers, p.caches):
                q = q0
                if "qkv" not in drop:
                    q = norm_qkv_rope(
                        h, qkv, None, nw, 1e-5, p.positions, p.cos, p.sin, kc, vc,
                        meta.slot_mapping, hq, pdl=True,
                    )  # fmt: skip
                a = q
                if "attention" not in drop:
                    a = decode_attention(
                        q, kc, vc, meta, d**-0.5, pdl=True,
                        num_kv_splits=1 if "splits" in drop else attn.get("splits"),
                        config=attn.get("config"),
                    )  # fmt: skip
                if "o" not in drop:
                    h = gemv(a.view(1, -1), o, residual=h)
                if "+nop" in drop:
                    _empty_pdl_kernel[nop_grid](launch_pdl=True)
                act = gemv(
                    h, gate_up[:inter], up_weight=gate_up[inter:], norm_weight=nw, eps=1e-5,
                )  # fmt: skip
                h = gemv(act, down, residual=h)
            if "lm_head" not in drop:
                gemv(h, p.lm_head, norm_weight=nw, eps=1e-5)

        return fn

    print(
        f"{torch.cuda.get_device_name()}: TinyLlama-1.1B shape, {layers} layers + lm_head, "
        f"batch 1, bf16, context {ctx}, PDL on; decode_attention with {splits} KV splits "
        f"(its count for max_model_len {max_model_len}, as the engine's graphs use it)",
        flush=True,
    )
    # The whole step is timed again after every variant, and each variant is compared with the
    # mean of the whole-step times on either side of it: in one session-12 call the same
    # configuration measured 694.8 us first and 719.9 us ~40 graphs later, a drift larger than
    # most of the differences this bench is after.
    whole_fn = step(set())
    last_whole = [P.timed_graph(whole_fn)]

    def timed_vs_whole(fn) -> tuple[float, float]:
        t = P.timed_graph(fn)
        after = P.timed_graph(whole_fn)
        base = (last_whole[0] + after) / 2
        last_whole[0] = after
        return t, base

    only = opts.get("only")  # keep the variants whose name has this word (and the whole step)
    for name, drop in VARIANTS.items():
        if only and name != "whole step" and only not in name:
            continue
        if drop:
            t, base = timed_vs_whole(step(drop))
        else:  # the whole step itself
            t = base = last_whole[0]
        nbytes = p.weight_bytes(drop)
        print(
            f"  {name}: {t * 1e6:.1f} us/step ({(base - t) * 1e6 / layers:+.2f} us a layer "
            f"saved vs the whole step around it, {base * 1e6:.1f}); weights "
            f"{nbytes / 1e9:.2f} GB, bound {nbytes / P.HBM * 1e6:.0f} us "
            f"({nbytes / P.HBM / t:.0%})",
            flush=True,
        )
    if opts.get("wide") == "1":
        # no split (so no reduce kernel): the whole context one key tile, read before the wait
        print(f"decode_attention, 1 split, one tile of BLOCK_N >= {ctx} keys:", flush=True)
        for block_n in (256, 512, 1024):
            if block_n < ctx:
                continue
            for warps in (4, 8, 16):
                cfg = AttentionConfig(dec.block_m, dec.block_q, block_n, warps, 1, True)
                try:
                    t, base = timed_vs_whole(step(set(), dict(splits=1, config=cfg)))
                except Exception as exc:  # noqa: BLE001  (e.g. out of registers / shared memory)
                    print(f"  BLOCK_N {block_n}, {warps} warps: {type(exc).__name__}", flush=True)
                    continue
                print(f"  BLOCK_N {block_n}, {warps} warps: {t * 1e6:.1f} us/step "
                      f"({(base - t) * 1e6 / layers:+.2f} us a layer)", flush=True)  # fmt: skip
    if opts.get("warps") == "1":
        # decode_attention compiled for sm_90 (Triton 3.6) at this shape spills at
        # decode_config's 4 warps (255 registers, ~440-970 spill instructions); 8 warps or a
        # 64-key tile do not (decode_attention_config, the default, takes 8)
        print("decode_attention warps x BLOCK_N (one key tile a split, as the engine):", flush=True)
        for block_n in (64, 128):
            n = DA.choose_decode_num_kv_splits(1, 4, max_model_len, block_n, torch.device("cuda"))
            for warps in (4, 8):
                cfg = AttentionConfig(dec.block_m, dec.block_q, block_n, warps, dec.num_stages,
                                      True)  # fmt: skip
                t, base = timed_vs_whole(step(set(), dict(splits=n, config=cfg)))
                print(f"  BLOCK_N {block_n} ({n} splits), {warps} warps: {t * 1e6:.1f} us/step "
                      f"({(base - t) * 1e6 / layers:+.2f} us a layer)", flush=True)  # fmt: skip
    if opts.get("attn") == "1":
        # smaller programs: fewer warps (so fewer cross-warp softmax reductions through shared
        # memory after the wait) and narrower key tiles, more splits for the reduce to combine
        print("decode_attention warps x BLOCK_N x splits:", flush=True)
        for warps, block_n, n in (
            (8, 128, splits), (4, 64, 32), (2, 64, 32), (2, 32, 64), (1, 32, 64), (1, 16, 128),
        ):  # fmt: skip
            cfg = AttentionConfig(dec.block_m, dec.block_q, block_n, warps, dec.num_stages, True)
            t, base = timed_vs_whole(step(set(), dict(splits=n, config=cfg)))
            print(f"  {warps} warps x BLOCK_N {block_n} x {n} splits: {t * 1e6:.1f} us/step "
                  f"({(base - t) * 1e6 / layers:+.2f} us a layer)", flush=True)  # fmt: skip
    if opts.get("splits") != "1":
        return
    print(f"decode_attention splits x BLOCK_N (default: {splits} x {dec.block_n}):", flush=True)
    for block_n in (64, 128):
        for n in (2, 4, 8, 16, 32):
            cfg = AttentionConfig(dec.block_m, dec.block_q, block_n, dec.num_warps,
                                  dec.num_stages, True)  # fmt: skip
            t, base = timed_vs_whole(step(set(), dict(splits=n, config=cfg)))
            print(f"  {n} splits x BLOCK_N {block_n}: {t * 1e6:.1f} us/step "
                  f"({(base - t) * 1e6 / layers:+.2f} us a layer)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
