"""Does programmatic dependent launch (PDL) close the batch-1 gap? A chain of batch-1 GEMVs.

    python evals/pdl_chain_bench.py [only=fused]

At batch 1 every projection of the TinyLlama-1.1B shape is a 2-46 MB weight read, and each kernel
pays a ramp (launch, first loads in flight) and a drain (last wave) while HBM idles: cuBLAS reads
the 8-10 MB q/k/v and o weights at only ~1.5 TB/s (evals/h200/skinny-gemm-bench-s5-*). With PDL
the next kernel is scheduled while the previous one drains; before it waits on the previous kernel
(griddepcontrol.wait) it can already ask for its weights (a bulk prefetch of its weight tile into
L2), which do not depend on the previous kernel. This bench times 22 layers x (qkv, o, gate_up,
down), every weight distinct (1.9 GB, far over L2), captured in one CUDA graph:
cuBLAS, a Triton GEMV, the same with PDL, and with PDL + L2 prefetch; then the small-batch
forward's own fused GEMVs (kernels/fused_gemv.py, with norm, SiLU-mul and residual) with and
without PDL. (A K-loop variant of that kernel measured 40 us a layer and was removed:
evals/h200/pdl-chain-bench-s5-*.)
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # evals/kernels.py must not shadow the PyPI `kernels` package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

HBM = 4.2e12
LAYER = [(2048, 2560), (2048, 2048), (2048, 11264), (5632, 2048)]  # (K, N): qkv, o, gate_up, down


@triton.jit
def _l2_prefetch(ptr, nbytes):
    # one bulk prefetch of a contiguous byte range into L2 (sm_90), issued by thread 0 only
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptr + tl.zeros([1], tl.int32), tl.full([1], nbytes, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _gemv(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()  # the next kernel may be scheduled once all our programs started
    if PREFETCH:
        _l2_prefetch(w_ptr + pid * BLOCK_N * K, BLOCK_N * K * 2)
    if PDL:
        gdc_wait()  # x comes from the previous kernel
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        w = tl.load(w_ptr + offs_n[:, None] * K + k[None, :], mask=k[None, :] < K, other=0.0)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def gemv(x, w, y, pdl, prefetch, block_n=4, block_k=512, warps=4):
    n, k = w.shape
    _gemv[(triton.cdiv(n, block_n),)](
        x, w, y, n, k, block_n, block_k, pdl, prefetch, num_warps=warps, launch_pdl=pdl
    )


def timed_graph(fn) -> float:
    """Seconds per CUDA-graph replay of fn: evals/kernels.py's bench_graph (median, L2 flushed)."""
    from hf_paged.testing import load_evals

    load_evals()  # evals/ as the package hf_paged_evals
    return importlib.import_module("hf_paged_evals.kernels").bench_graph(fn) / 1e3


def main() -> None:
    opts = dict(arg.split("=") for arg in sys.argv[1:])
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = 22
    ws = [
        [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for k, n in LAYER]
        for _ in range(layers)
    ]
    nbytes = sum(w.numel() * 2 for lw in ws for w in lw)
    x = torch.randn(11264, device=dev, dtype=torch.bfloat16)
    ys = [torch.empty(n, device=dev, dtype=torch.bfloat16) for _, n in LAYER]
    # each GEMV reads the previous one's output (a real dependency chain)
    srcs = [ys[3], ys[0], ys[1], ys[2]]
    srcs[0] = x

    def chain(kind, **kw):
        def fn():
            for lw in ws:
                for i, w in enumerate(lw):
                    src = srcs[i]
                    if kind == "cublas":
                        torch.mv(w, src[: w.shape[1]], out=ys[i])
                    else:
                        gemv(src, w, ys[i], **kw)

        return fn

    ref = F.linear(x[:2048], ws[0][0])
    for pdl, pf in ((False, False), (True, False), (True, True)):
        y = torch.empty(2560, device=dev, dtype=torch.bfloat16)
        gemv(x, ws[0][0], y, pdl, pf)
        torch.cuda.synchronize()
        err = (y.float() - ref.float()).abs().max().item()
        print(f"gemv pdl={pdl} prefetch={pf}: max abs diff vs F.linear {err:.3g}", flush=True)
    print(
        f"{torch.cuda.get_device_name()}: {layers} layers x (qkv, o, gate_up, down) of the 1.1B "
        f"shape, batch 1, bf16, {nbytes / 1e9:.2f} GB of weights; bound {nbytes / HBM * 1e6:.0f} us"
    )
    variants = [
        ("cuBLAS (torch.mv)", chain("cublas")),
        ("Triton GEMV", chain("t", pdl=False, prefetch=False)),
        ("Triton GEMV + PDL", chain("t", pdl=True, prefetch=False)),
        ("Triton GEMV + PDL + L2 prefetch", chain("t", pdl=True, prefetch=True)),
    ]
    for bn, bk, warps in ((2, 1024, 4), (4, 512, 2), (8, 256, 4), (4, 1024, 4)):
        variants.append(
            (
                f"PDL + prefetch, BLOCK_N {bn} BLOCK_K {bk} warps {warps}",
                chain("t", pdl=True, prefetch=True, block_n=bn, block_k=bk, warps=warps),
            )
        )
    # hf_paged's fused layer GEMVs (kernels/fused_gemv.py), the real per-layer sequence:
    # RMSNorm + qkv, o + residual, RMSNorm + gate/up + SiLU-mul, down + residual
    fg = importlib.import_module("hf_paged.kernels.fused_gemv")

    hidden, inter = 2048, 5632
    norm_w = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5
    h0 = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)

    def layer_chain(pdl, i32=True):
        def fn():
            fg._ROWS_I32 = i32  # read at each launch; a graph keeps what it captured
            h = h0
            for qkv, o, gate_up, down in ws:
                a = fg.fused_gemv(h, qkv, norm_weight=norm_w, eps=1e-5, pdl=pdl)
                h = fg.fused_gemv(a[:, :hidden], o, residual=h, pdl=pdl)
                act = fg.fused_gemv(
                    h,
                    gate_up[:inter],
                    up_weight=gate_up[inter:],
                    norm_weight=norm_w,
                    eps=1e-5,
                    pdl=pdl,
                )
                h = fg.fused_gemv(act, down, residual=h, pdl=pdl)
            out.copy_(h)

        return fn

    out = torch.empty_like(h0)
    layer_chain(True, False)()
    want = out.clone()
    layer_chain(True, True)()
    print(f"fused_gemv, 32-bit against 64-bit weight offsets: same output {torch.equal(out, want)}")

    if opts.get("only") == "fused":  # the engine's kernels, 32-bit weight offsets or not, twice
        variants = [
            (f"fused_gemv layer chain, PDL, 32-bit offsets {i32}", layer_chain(True, i32))
            for _ in range(2)
            for i32 in (False, True)
        ]
    else:
        for pdl in (False, True):
            variants.append((f"fused_gemv layer chain, PDL {pdl}", layer_chain(pdl)))
    for name, fn in variants:
        try:
            t = timed_graph(fn)
        except Exception as exc:  # report and go on: one variant's failure is a result too
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        print(
            f"{name}: {t * 1e6:.0f} us per pass ({t / layers * 1e6:.1f} us per layer), "
            f"{nbytes / t / 1e12:.2f} TB/s, {nbytes / HBM / t:.0%} of bound",
            flush=True,
        )


if __name__ == "__main__":
    main()
