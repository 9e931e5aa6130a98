"""Can a kernel boundary cost less than PDL's whole-grid wait? Flag-in-data handoffs, batch 1.

    python evals/ll_chain_bench.py [layers=22]

An experiment, not a code path of the engine. The batch-1 step is a chain of ~6 kernels a layer,
and each boundary costs about 2 us on the H200 (evals/batch1_critical_path.py: one empty PDL
kernel a layer adds 1.8-2.0 us a layer) for ~490 us of weight reads. Completion counters (branch
flag-sync, evals/h200/batch1-critical-path-counters-*) cost more than they saved: every producer
program pays a release fence before it exits. This bench tries a handoff with no fence at all,
NCCL's "LL" idea: each 8-byte word a producer stores carries two bf16 outputs and a 32-bit flag
(the step's epoch); an aligned 8-byte store is single-copy atomic, so a consumer that reads a word
with the current epoch has its data.
Consumers skip griddepcontrol.wait and re-read (volatile) the words not yet flagged.

The chain: 22 layers x (o 2048->2048, gate/up 2048->2x5632 with SiLU-mul, down 5632->2048) at
the TinyLlama-1.1B shape, every weight distinct, in one CUDA graph; the same GEMV kernel with PDL
waits and with LL handoffs, and the engine's fused_gemv chain for reference. The LL results are
checked against the PDL chain's before timing.

Measured (evals/h200/ll-chain-bench-s8-*): PDL waits 481 us, LL handoffs 702 us whatever the
sleep between polls: every program of every wave, not just the first, reads its input with
volatile loads and checks the flags, where with PDL the later waves' wait is already over.
Median of graph replays, L2 flushed before each
(evals/kernels.py bench_graph); bound = weight bytes / 4.2 TB/s.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # evals/kernels.py must not shadow the PyPI `kernels` package

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hf_paged.kernels import fused_gemv  # noqa: E402
from hf_paged.kernels.fused_gemv import (  # noqa: E402
    gdc_launch_dependents,
    gdc_wait,
    tile_config,
)

HBM = 4.2e12
HIDDEN, INTER = 2048, 5632


@triton.jit
def _nanosleep(ns: tl.constexpr):
    tl.inline_asm_elementwise(
        f"nanosleep.u32 {ns}; mov.u32 $0, 0;", "=r,r", [tl.zeros([1], tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _flagged(words, epoch, valid):
    return ((words >> 32).to(tl.int32) == epoch) | ~valid


@triton.jit
def _gemv_ll(
    x_ptr, w_ptr, w2_ptr, y_ptr, epoch_ptr, N,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr,
    LL_IN: tl.constexpr, LL_OUT: tl.constexpr, SLEEP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    gdc_launch_dependents()
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K_PAD)
    n_mask = offs_n < N
    k_mask = offs_k < K
    tile = n_mask[:, None] & k_mask[None, :]
    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], tile, 0.0).to(tl.float32)
    w2 = w
    if GATED:
        w2 = tl.load(w2_ptr + offs_n[:, None] * K + offs_k[None, :], tile, 0.0).to(tl.float32)
    if LL_IN:
        # x arrives as K/2 words (two bf16 + the epoch): re-read the ones not flagged yet
        epoch = tl.load(epoch_ptr, volatile=True)
        offs_h = tl.arange(0, K_PAD // 2)
        h_mask = offs_h < K // 2
        words = tl.load(x_ptr + offs_h, mask=h_mask, other=0, volatile=True)
        ok = _flagged(words, epoch, h_mask)
        while tl.min(ok.to(tl.int32), axis=0) == 0:
            _nanosleep(SLEEP)
            again = tl.load(x_ptr + offs_h, mask=h_mask & ~ok, other=0, volatile=True)
            words = tl.where(ok, words, again)
            ok = _flagged(words, epoch, h_mask)
        lo = (words & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = ((words >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        x = tl.interleave(lo, hi).to(tl.float32)
    else:
        gdc_wait()
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    y = tl.sum(w * x[None, :], axis=1)
    if GATED:
        gate = y.to(tl.bfloat16).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(tl.bfloat16).to(tl.float32)
        y = act * tl.sum(w2 * x[None, :], axis=1).to(tl.bfloat16).to(tl.float32)
    if LL_OUT:
        epoch = tl.load(epoch_ptr, volatile=True)
        bits = y.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int64)
        lo, hi = tl.split(tl.reshape(bits, [BLOCK_N // 2, 2]))
        word = lo | (hi << 16) | (epoch.to(tl.int64) << 32)
        offs_w = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + offs_w, word, mask=offs_w < N // 2)
    else:
        tl.store(y_ptr + offs_n, y.to(tl.bfloat16), mask=n_mask)


def gemv_ll(x, w, w2, y, epoch, ll_in, ll_out, sleep=100):
    n, k = w.shape
    cfg = tile_config(k, w2 is not None)  # the engine's fused_gemv tile for this shape
    block_n, warps = cfg["BLOCK_N"], cfg["num_warps"]
    _gemv_ll[(triton.cdiv(n, block_n),)](
        x, w, w2 if w2 is not None else w, y, epoch, n, k, triton.next_power_of_2(k), block_n,
        w2 is not None, ll_in, ll_out, sleep, num_warps=warps, launch_pdl=True,
    )  # fmt: skip


def main() -> None:
    opts = dict(arg.split("=") for arg in sys.argv[1:])
    layers = int(opts.get("layers", 22))
    dev = torch.device("cuda")
    torch.manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02

    ws = [(w(HIDDEN, HIDDEN), w(INTER, HIDDEN), w(INTER, HIDDEN), w(HIDDEN, INTER))
          for _ in range(layers)]  # fmt: skip
    nbytes = sum(t.numel() * 2 for lw in ws for t in lw)
    x0 = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    epoch = torch.zeros(1, dtype=torch.int32, device=dev)
    # LL words: a buffer per layer and site (a flag marks a step, so a buffer is written once)
    ll = [
        tuple(torch.zeros(n // 2, dtype=torch.int64, device=dev) for n in (HIDDEN, INTER, HIDDEN))
        for _ in range(layers)
    ]
    plain = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for n in (HIDDEN, INTER, HIDDEN)]
    out = torch.empty(1, HIDDEN, device=dev, dtype=torch.bfloat16)

    def chain(mode, sleep=100):
        def fn():
            if mode == "fused_gemv":
                h = x0
                for o, gate, up, down in ws:
                    h = fused_gemv(h, o, pdl=True)
                    act = fused_gemv(h, gate, up_weight=up, pdl=True)
                    h = fused_gemv(act, down, pdl=True)
                out.copy_(h)
                return
            epoch.add_(1)  # this replay's flag: every LL word of the last one is stale now
            llm = mode == "ll"
            src, first = x0, True
            for li, (o, gate, up, down) in enumerate(ws):
                lo, lg, ld = ll[li] if llm else plain
                last = li == layers - 1
                gemv_ll(src, o, None, lo, epoch, llm and not first, llm)
                gemv_ll(lo, gate, up, lg, epoch, llm, llm)
                gemv_ll(lg, down, None, out if last else ld, epoch, llm, llm and not last)
                src, first = (out if last else ld), False

        return fn

    # the LL chain computes what the PDL chain computes (bit for bit: the same kernel's math)
    chain("pdl")()
    want = out.clone()
    chain("ll")()
    torch.cuda.synchronize()
    same = torch.equal(out, want)
    print(f"LL chain equals the PDL-wait chain: {same}", flush=True)
    if not same:
        raise SystemExit("LL handoff gave different results")
    load_evals = importlib.import_module("hf_paged.testing").load_evals
    load_evals()
    bench_graph = importlib.import_module("hf_paged_evals.kernels").bench_graph
    print(
        f"{torch.cuda.get_device_name()}: {layers} layers x (o, gate/up + SiLU-mul, down) of the "
        f"1.1B shape, batch 1, bf16, {nbytes / 1e9:.2f} GB of weights; bound "
        f"{nbytes / HBM * 1e6:.0f} us",
        flush=True,
    )
    base = None
    variants = [("fused_gemv chain, PDL waits (the engine's kernel)", chain("fused_gemv")),
                ("bench GEMV, PDL waits", chain("pdl"))]  # fmt: skip
    variants += [(f"bench GEMV, LL handoffs, {s} ns sleep", chain("ll", s)) for s in (0, 100, 500)]
    for name, fn in variants:
        t = bench_graph(fn) / 1e3
        base = t if base is None else base
        print(
            f"  {name}: {t * 1e6:.1f} us ({t / layers * 1e6:.2f} us a layer, "
            f"{(base - t) / layers * 1e6:+.2f} vs the first); {nbytes / HBM / t:.0%} of bound",
            flush=True,
        )
    # after timing: the graphs replayed many times, each with a new epoch; still the same result
    chain("ll")()
    torch.cuda.synchronize()
    print(f"LL chain after the timed replays equals the PDL chain: {torch.equal(out, want)}")


if __name__ == "__main__":
    main()
