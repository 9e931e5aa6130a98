"""End-to-end agreement of the attention backends: Triton vs torch vs transformers' generate.

    python evals/backend_parity.py [--prompts 64] [--new 128] [--layers 22] [--dtype bfloat16]

TinyLlama-1.1B shape with random weights (no weights can be fetched on the GPU machine), greedy,
left-padded prompts of 16-512 random tokens. Prints, for each pair, the rate of identical output
sequences and where the first differing token falls. In bfloat16, near-tied logits of random
weights break differently under different (equally valid) summation orders, so a pair diverges
somewhere; a systematic bug diverges at the first tokens of most rows. The noise floor is printed
alongside: transformers against itself with its two attention implementations (sdpa vs eager),
two equally valid orders of the same arithmetic. In float32 every pair should agree.

    python evals/backend_parity.py --dtype bfloat16,float32 --backends triton,torch
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # evals/kernels.py must not shadow the PyPI `kernels` package

import torch  # noqa: E402


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> list[int | None]:
    """Per row: index of the first differing new token, None when the rows are identical."""
    out = []
    for x, y in zip(a.tolist(), b.tolist()):
        out.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None))
    return out


def summarize(name: str, a: torch.Tensor, b: torch.Tensor) -> str:
    div = first_divergence(a, b)
    diverged = [d for d in div if d is not None]
    same = len(div) - len(diverged)
    where = (
        f"first divergence: min {min(diverged)}, median {statistics.median(diverged):.0f}, "
        f"max {max(diverged)} (of {a.shape[1]} tokens)"
        if diverged
        else "no divergence"
    )
    at_first = sum(d == 0 for d in div)
    return (
        f"| {name} | {same}/{len(div)} ({same / len(div):.0%}) | {at_first}/{len(div)} | {where} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--dtype", default="bfloat16", help="comma-separated: bfloat16,float32")
    ap.add_argument("--backends", default="triton,torch", help="hf_paged attention backends")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    for dtype in args.dtype.split(","):
        compare(args, dtype, args.backends.split(","))


def compare(args, dtype_name: str, backends: list[str]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_paged

    dtype = getattr(torch, dtype_name)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 513, (args.prompts,), generator=g).tolist()
    width = max(lengths)
    ids = torch.zeros((args.prompts, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, 32000, (n,), generator=g)
        mask[i, width - n :] = 1
    ids, mask = ids.to(args.device), mask.to(args.device)
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)

    outs, times = {}, {}
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        t = time.perf_counter()
        outs[impl] = model.generate(input_ids=ids, attention_mask=mask, **gen)[:, width:]
        times[f"transformers {impl}"] = time.perf_counter() - t
    model.set_attn_implementation("sdpa")
    for backend in backends:
        hf_paged.patch(model, attention_backend=backend, cuda_graphs=backend == "triton")
        t = time.perf_counter()
        outs[backend] = model.generate(input_ids=ids, attention_mask=mask, **gen)[:, width:]
        times[backend] = time.perf_counter() - t
        hf_paged.unpatch(model)

    print(
        f"\nmodel: TinyLlama-1.1B shape, {args.layers} layers, {dtype_name}, random weights; "
        f"{args.prompts} prompts of 16-512 tokens x {args.new} greedy tokens; "
        f"device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}"
    )
    print("| pair | identical sequences | differ at token 0 | where rows first differ |")
    print("|---|---|---|---|")
    print(summarize("noise floor: transformers sdpa vs eager", outs["sdpa"], outs["eager"]))
    for backend in backends:
        print(summarize(f"{backend} vs transformers sdpa", outs[backend], outs["sdpa"]))
        print(summarize(f"{backend} vs transformers eager", outs[backend], outs["eager"]))
    if len(backends) > 1:
        a, b = backends[:2]
        print(summarize(f"{a} vs {b} backend", outs[a], outs[b]))
    print("wall seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))


if __name__ == "__main__":
    main()
