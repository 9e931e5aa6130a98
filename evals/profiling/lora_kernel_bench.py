"""Multi-LoRA kernels of one decoder layer on a GPU, against the same layer without adapters.

    python evals/profiling/lora_kernel_bench.py [--shape tinyllama-1.1b|llama-3-8b] [--rank 16]
        [--slots 8] [--used 8] [--host]

Random bf16 weights and adapters (rank --rank on all seven projections, --slots slots, rows
spread over the first --used slots and the base model; --used 1: one adapter of many, as W1 with
one adapter), timed as CUDA-graph replays with L2 flushed (bench_setup.bench_graph), medians in
microseconds:

- small batch (1-8 rows, hf_paged/worker/small_batch_forward.py's kernels, PDL where the GPU has
  it): the layer's four fused GEMVs (norm + q/k/v, o + residual, norm + gate/up + SiLU-mul,
  down + residual) without adapters, then with them: one shrink per group and the deltas in the
  GEMVs' epilogues (kernels/lora_epilogue.py::LoraEpilogue). Attention and RoPE are left out
  (the same with and without adapters). The bound: the layer's weight bytes at the H200's bandwidth.
- many tokens (the transformers forward's path): the layer's four GEMMs (cuBLAS), then the LoRA
  ops: folded (each GEMM's weight with the slots' A rows appended, one expand reading the
  token's slot's columns: hf_paged/lora/fold.py, the default where it fits), grouped (q/k/v and
  gate/up one shrink + one expand each: 4 shrinks, 4 expands) and per slice (7 shrink + expand
  pairs on the slices' views, as before grouping).

--host: instead, the host's microseconds per call of the folded path's LoRA op (the engine's
custom op reading the step's LoRA batch from the forward context), of its expand launcher with
and without argument checks, and of an empty custom op of the same signature. An eager prefill
step calls the op once per LoRA group of every layer (88 times on the 1.1B shape), and its host
time is on the step's critical path where the host, not the GPU, bounds the step.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_setup import PEAK_BW, bench_graph

# hidden, (q, k, v) widths, intermediate
DIMS = {
    "tinyllama-1.1b": (2048, (2048, 256, 256), 5632),
    "llama-3-8b": (4096, (4096, 1024, 1024), 14336),
}


def _slots(t: int, used: int) -> torch.Tensor:
    """Row i on slot i % (used + 1), the last of each cycle on the base model (-1)."""
    s = torch.arange(t, device="cuda") % (used + 1)
    return torch.where(s == used, -1, s).to(torch.int32)


class Layer:
    def __init__(self, hidden, qkv, inter, rank, slots, used=None):
        g = torch.Generator(device="cuda").manual_seed(0)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

        self.hidden, self.qkv, self.inter, self.slots, self.rank = hidden, qkv, inter, slots, rank
        self.used = slots if used is None else used
        self.w_qkv = rnd(sum(qkv), hidden, scale=hidden**-0.5)
        self.w_o = rnd(hidden, hidden, scale=hidden**-0.5)
        self.w_gu = rnd(2 * inter, hidden, scale=hidden**-0.5)
        self.w_down = rnd(hidden, inter, scale=inter**-0.5)
        self.norm = torch.ones(hidden, device="cuda").bfloat16()
        # group buffers as hf_paged/lora/slots.py lays them out
        self.groups = {}
        for name, k, widths in (
            ("qkv", hidden, qkv),
            ("o", hidden, (hidden,)),
            ("gate_up", hidden, (inter, inter)),
            ("down", inter, (hidden,)),
        ):
            a = rnd(slots, len(widths) * rank, k, scale=k**-0.5)
            b = rnd(slots, sum(widths), rank, scale=0.01)
            scale = torch.full((len(widths), slots), 2.0, device="cuda")
            self.groups[name] = (a, b, scale, widths)
        # the folded layout (hf_paged/lora/fold.py): each weight with its slots' A rows after it
        self.ext = {
            name: torch.cat([w, self.groups[name][0].reshape(-1, w.shape[1])])
            for name, w in (
                ("qkv", self.w_qkv), ("o", self.w_o), ("gate_up", self.w_gu), ("down", self.w_down)
            )
        }  # fmt: skip

    def weight_bytes(self) -> int:
        return sum(w.numel() * 2 for w in (self.w_qkv, self.w_o, self.w_gu, self.w_down))

    def small_batch(self, rows: int, lora: bool, pdl: bool):
        from hf_paged.kernels import LoraEpilogue, fused_gemv, lora_rows_shrink

        h = torch.randn(rows, self.hidden, device="cuda").bfloat16()
        attn = torch.randn(rows, self.hidden, device="cuda").bfloat16()
        slots = _slots(rows, self.used)
        inter = self.inter

        def epilogue(x, name, normed):
            if not lora:
                return None
            a, b, scale, widths = self.groups[name]
            kw = dict(norm_weight=self.norm) if normed else {}
            s = lora_rows_shrink(x, a, slots, pdl=pdl, **kw)
            return LoraEpilogue(s, b, scale, slots, widths, rms=normed)

        def layer():
            norm = dict(norm_weight=self.norm, eps=1e-5, pdl=pdl)
            fused_gemv(h, self.w_qkv, lora=epilogue(h, "qkv", True), **norm)
            h2 = fused_gemv(attn, self.w_o, residual=h, pdl=pdl, lora=epilogue(attn, "o", False))
            act = fused_gemv(
                h2, self.w_gu[:inter], up_weight=self.w_gu[inter:],
                lora=epilogue(h2, "gate_up", True), **norm,
            )  # fmt: skip
            fused_gemv(act, self.w_down, residual=h2, pdl=pdl, lora=epilogue(act, "down", False))

        return layer

    def many_tokens(self, t: int, mode: str):
        from hf_paged.kernels import lora_expand, lora_segments, lora_shrink
        from hf_paged.kernels.lora import lora_expand_folded

        x = torch.randn(t, self.hidden, device="cuda").bfloat16()
        xi = torch.randn(t, self.inter, device="cuda").bfloat16()
        slots = _slots(t, self.used)
        seg = lora_segments(slots, self.slots)  # once a step in the engine, not per group
        r = self.rank

        def lora(y, x_in, name):
            a, b, scale, widths = self.groups[name]
            if mode == "grouped":
                lora_expand(y, lora_shrink(x_in, a, *seg), b, scale, *seg, slices=widths)
                return
            start = 0
            for i, w in enumerate(widths):  # each slice on its own, through the views
                part, view_a = y[:, start : start + w], a[:, i * r : (i + 1) * r]
                lora_expand(part, lora_shrink(x_in, view_a, *seg), b[:, start : start + w],
                            scale[i], *seg)  # fmt: skip
                start += w

        def folded(x_in, name):
            a, b, scale, widths = self.groups[name]
            full = F.linear(x_in, self.ext[name])
            n = sum(widths)
            lora_expand_folded(full[:, :n], full[:, n:], b, scale, *seg, slices=widths)

        def layer():
            if mode == "folded":
                folded(x, "qkv")
                folded(x, "o")
                folded(x, "gate_up")
                folded(xi, "down")
                return
            qkv = F.linear(x, self.w_qkv)
            o = F.linear(x, self.w_o)
            gu = F.linear(x, self.w_gu)
            down = F.linear(xi, self.w_down)
            if mode != "base":
                lora(qkv, x, "qkv")
                lora(o, x, "o")
                lora(gu, x, "gate_up")
                lora(down, xi, "down")

        return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tinyllama-1.1b", choices=list(DIMS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--used", type=int, default=None, help="slots the rows use (all)")
    parser.add_argument(
        "--tokens", default="16,64,256,512",
        help="token counts of the many-token rows (comma list; prefill chunks reach 8192)",
    )  # fmt: skip
    parser.add_argument(
        "--host", action="store_true", help="host time per LoRA op call instead (see above)"
    )
    parser.add_argument(
        "--profile", action="store_true",
        help="kernels by time: 1 row with LoRA, then each --tokens count grouped",
    )  # fmt: skip
    args = parser.parse_args()
    from hf_paged.kernels.fused_gemv import pdl_available

    hidden, qkv, inter = DIMS[args.shape]
    if args.host:
        host_calls(qkv, args.rank, args.slots)
        return
    used = min(args.used or args.slots, args.slots)
    layer = Layer(hidden, qkv, inter, args.rank, args.slots, used)
    pdl = pdl_available(torch.device("cuda"))
    bound = layer.weight_bytes() / PEAK_BW * 1e6
    print(
        f"## {args.shape}, rank {args.rank}, {args.slots} slots ({used} used), one decoder layer\n"
    )
    print(f"small batch (PDL {'on' if pdl else 'off'}); weight-read bound {bound:.1f} us\n")
    print("| rows | base us | LoRA us | base / LoRA |")
    print("| --- | --- | --- | --- |")
    for rows in (1, 2, 4, 8):
        base = bench_graph(layer.small_batch(rows, False, pdl)) * 1e3
        with_lora = bench_graph(layer.small_batch(rows, True, pdl)) * 1e3
        print(f"| {rows} | {base:.1f} | {with_lora:.1f} | {base / with_lora:.1%} |", flush=True)
    print("\nmany tokens (cuBLAS GEMMs + LoRA ops)\n")
    modes = ("base", "folded", "grouped", "slices")
    print(
        "| tokens | " + " | ".join(f"{m} us" for m in modes) + " | base / folded | base / grouped |"
    )
    print("|" + " --- |" * (len(modes) + 3))
    for t in (int(v) for v in args.tokens.split(",")):
        times = {m: bench_graph(layer.many_tokens(t, m)) * 1e3 for m in modes}
        b, fo, gr = times["base"], times["folded"], times["grouped"]
        cells = " | ".join(f"{times[m]:.1f}" for m in modes)
        print(f"| {t} | {cells} | {b / fo:.1%} | {b / gr:.1%} |", flush=True)
    if args.profile:
        _profile("small batch, 1 row, LoRA", layer.small_batch(1, True, pdl))
        for t in (int(v) for v in args.tokens.split(",")):
            for mode in ("folded", "grouped"):
                _profile(f"many tokens, {t}, {mode}", layer.many_tokens(t, mode))


def host_calls(widths, rank: int, slots: int, tokens: int = 64, calls: int = 2000) -> None:
    """Host microseconds per call (a few tokens: the GPU keeps up, so no call waits for it)."""
    import time

    from hf_paged.kernels.lora import lora_expand_folded, lora_segments

    from hf_paged.lora.batch import LoraBatch
    from hf_paged.lora.fold import fold_add_
    from hf_paged.worker.forward_context import ForwardContext, forward_context

    @torch.library.custom_op("lora_kernel_bench::empty_", mutates_args=("full",))
    def empty_(full: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, sizes: list[int]) -> None:
        return None

    sizes = list(widths)
    n = sum(sizes)
    full = torch.zeros(tokens, n + slots * len(sizes) * rank, device="cuda").bfloat16()
    b = torch.zeros(slots, n, rank, device="cuda").bfloat16()
    scale = torch.ones(len(sizes), slots, device="cuda")
    token_slots = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    seg = lora_segments(token_slots, slots)
    y, s_all = full[:, :n], full[:, n:]
    runs = {
        "the engine's op (hf_paged::lora_fold_add_)": lambda: fold_add_(full, b, scale, sizes),
        "lora_expand_folded": lambda: lora_expand_folded(y, s_all, b, scale, *seg, sizes),
        "lora_expand_folded, check=False": lambda: lora_expand_folded(
            y, s_all, b, scale, *seg, sizes, check=False
        ),
        "an empty custom op": lambda: empty_(full, b, scale, sizes),
    }
    print(f"## host us per call: q/k/v group {sizes}, rank {rank}, {slots} slots, {tokens} tokens")
    print("| call | host us |\n| --- | ---: |")
    ctx = ForwardContext(None, [], None, lora_groups=LoraBatch(token_slots, *seg))
    with forward_context(ctx):
        for label, fn in runs.items():
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            spent = (time.perf_counter() - t) / calls * 1e6
            torch.cuda.synchronize()
            print(f"| {label} | {spent:.1f} |", flush=True)


def _profile(title: str, fn, reps: int = 10) -> None:
    """The kernels of fn by time (eager launches, so gaps between them are not counted)."""
    from bench_setup import kernel_rows
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"\n{title}: kernels per call{kernel_rows(events, reps, top=15)}")


if __name__ == "__main__":
    main()
