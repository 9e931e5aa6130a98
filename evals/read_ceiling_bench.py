"""How fast can this GPU read weights at all, and how close does one fused_gemv launch come?

    python evals/read_ceiling_bench.py

The batch-1 target (issue 5) is stated against 4.2 TB/s, the H200's measured copy rate (bytes
read + written). A GEMV only reads. This bench times, on ~1 GB of bf16 (far over L2, flushed
before each replay), each in one CUDA graph:

- torch's sum (its reduction kernel) and cuBLAS's matrix-vector product (torch.mv);
- a plain Triton read: programs stride over the tensor in BLOCK-element chunks and add them up
  (programs a SM x BLOCK x warps swept): what a streaming kernel can reach;
- kernels/fused_gemv.py at one row at the 1.1B and Llama-3-8B shapes' K (2048, 4096, gated
  2048 / 4096, 5632, 14336) with N large, so one launch runs for ~0.3 ms and its ramp and tail
  are noise: its steady-state rate, with tile_config's tile and others.

If fused_gemv's steady rate is near the read ceiling, the batch-1 step loses its time at kernel
boundaries (what a persistent kernel would remove); if not, inside each GEMV.

H200, session 11 (evals/h200/read-ceiling-*-s11-*): the plain read reaches 4.31 TB/s with ~32 KB
in flight a SM (1 program x 16K elements, 2 x 8K, 4 x 4K...) and 1.9-3.3 with 8-16 KB; torch.sum
4.0. fused_gemv streams at the ceiling (4.26-4.36) at K 2048 / 4096 and, with BLOCK_N 1-2 x 8
warps, at K 5632 / 14336, where its old 16-warp tiles read 3.1 / 3.8; gated K 2048 / 4096 4.1 /
4.05. So at batch 1 the time is lost at kernel boundaries. tile_config now takes the 8-warp
tiles for weights of 64 MB and more (Llama-3-8B batch 1: 234 against 226 tok/s); the 1.1B down
projection (23 MB) keeps its 16-warp tile, which is faster there between PDL waits.
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

HBM = 4.2e12


@triton.jit
def _read_sum(x_ptr, out_ptr, n_chunks, BLOCK: tl.constexpr):
    # program p adds chunks p, p + grid, ...: every byte read once, nothing but the loads
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(pid, n_chunks, grid):
        acc += tl.load(x_ptr + c.to(tl.int64) * BLOCK + offs).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def timed(fn) -> float:
    from hf_paged.testing import load_evals

    load_evals()
    return importlib.import_module("hf_paged_evals.kernels").bench_graph(fn) / 1e3


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    fg = importlib.import_module("hf_paged.kernels.fused_gemv")
    x = torch.randn(2**29, device=dev, dtype=torch.bfloat16)  # 1.07 GB
    nbytes = x.numel() * 2
    out = torch.empty(sms * 64, device=dev, dtype=torch.float32)
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), bf16, bound = bytes / {HBM / 1e12} TB/s")

    def report(name, fn, nb):
        try:
            t = timed(fn)
        except Exception as exc:  # one failing variant is a result too
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        print(f"  {name}: {nb / 1e9:.2f} GB in {t * 1e6:.1f} us = {nb / t / 1e12:.2f} TB/s "
              f"({nb / t / HBM:.0%} of 4.2)", flush=True)  # fmt: skip

    report("torch.sum", lambda: out[:1].copy_(torch.sum(x, dtype=torch.float32)), nbytes)
    for per_sm in (1, 2, 4, 8):
        for block, warps in ((4096, 4), (8192, 8), (16384, 8), (8192, 4)):
            grid = sms * per_sm
            n_chunks = x.numel() // block

            def fn(grid=grid, block=block, warps=warps, n_chunks=n_chunks):
                _read_sum[(grid,)](x, out, n_chunks, BLOCK=block, num_warps=warps)

            report(f"Triton read, {per_sm}/SM, BLOCK {block}, {warps} warps", fn, nbytes)
    h = torch.randn(1, 16384, device=dev, dtype=torch.bfloat16)
    tiles = {  # (K, gated): configs tried besides tile_config's
        (2048, False): [dict(BLOCK_N=8, num_warps=8), dict(BLOCK_N=2, num_warps=4)],
        (2048, True): [],
        (4096, False): [dict(BLOCK_N=2, num_warps=4)],
        (4096, True): [dict(BLOCK_N=4, num_warps=16), dict(BLOCK_N=2, num_warps=8)],
        (14336, False): [
            dict(BLOCK_N=2, num_warps=16),
            dict(BLOCK_N=1, num_warps=8),
            dict(BLOCK_N=1, num_warps=16),
        ],
        (5632, False): [
            dict(BLOCK_N=4, num_warps=16),
            dict(BLOCK_N=4, num_warps=8),
            dict(BLOCK_N=2, num_warps=8),
            dict(BLOCK_N=2, num_warps=4),
            dict(BLOCK_N=1, num_warps=4),
            dict(BLOCK_N=8, num_warps=16),
        ],
    }
    for (k, gated), extra in tiles.items():
        n = nbytes // (2 * k * (2 if gated else 1))
        w = x[: n * k].view(n, k)
        w2 = x[n * k : 2 * n * k].view(n, k) if gated else None
        nb = n * k * 2 * (2 if gated else 1)
        report(f"torch.mv K {k}, N {n}", lambda w=w, k=k: torch.mv(w, h[0, :k]), n * k * 2)
        for cfg in [None] + extra:

            def fn(w=w, w2=w2, k=k, cfg=cfg):
                fg.fused_gemv(h[:, :k], w, up_weight=w2, config=cfg)

            tile = cfg or f"{fg.tile_config(k, gated)} (tile_config)"
            report(f"fused_gemv K {k}{' gated' if gated else ''}, N {n}, {tile}", fn, nb)


if __name__ == "__main__":
    main()
