"""Multi-LoRA throughput: the base model vs 1 adapter vs N adapters spread over the requests.

    python evals/profiling/lora_bench.py [--shape llama-3-8b] [--adapters 8] [--rank 16]
        [--requests 256] [--new-tokens 256] [--hf-batch 64] [--device cuda] [--dtype bfloat16]
        [engine options: --compile 0 --max-loras 8 ...]

A model of the shape with random weights; W1's prompts (evals/workloads.py, the first
--requests), --new-tokens output tokens each, EOS ignored. First the base model on the engine
with its defaults (and the engine options given); then the same model as a PeftModel with
--adapters adapters of rank --rank on all seven projections (q/k/v/o, gate/up/down; lora_B drawn
at random so they cost what real ones do), all requests on one adapter, then request i on
adapter i % N. Then batch 1 (one 128-token prompt) without and with an adapter. Each run is
preceded by a warm-up on 8 prompts (Triton JIT, compile, graphs). With --hf-batch B > 0, the
same requests through transformers + peft generate in static batches of B (left padding, EOS
off, evals/backends.py's settings): one adapter (peft's active adapter), then the spread as
peft's adapter_names. Prints output tokens/s, the ratios to the base model, and the engine's
ratio to transformers + peft; the issue's targets: N adapters >= 85% of base, 1 adapter >= 90%,
batch 1 with an adapter >= 85% of batch 1 without.

--device cpu --dtype float32 --shape smollm2-135m runs the same on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_setup import SHAPES, add_engine_options, build_model, engine_options, w1_prompts

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(eng, prompts, names, new_tokens: int, device: str) -> float:
    """Output tokens/s of one generate call over these prompts (names[i]: request i's adapter)."""
    from hf_paged import SamplingParams

    params = [
        SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, adapter=name)
        for name in names
    ]
    warm = min(8, len(prompts))
    eng.generate(prompts[:warm], params[:warm])  # JIT, compile, graphs: not timed
    _sync(device)
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    _sync(device)
    wall = time.perf_counter() - t
    return sum(len(o.output_token_ids) for o in outs) / wall


def run_hf(model, prompts, names, new_tokens: int, batch: int, device: str) -> float:
    """Output tokens/s of transformers + peft generate in static batches (names: peft's
    adapter_names per row, or None: the active adapter)."""
    from hf_paged_evals.backends import _left_pad, _pad_id, hf_generate_config

    dev = torch.device(device)
    config = hf_generate_config(model, new_tokens)
    pad = _pad_id(model)
    with torch.inference_mode():  # warm-up outside the clock
        ids, mask = _left_pad([[17] * 16], pad, dev)
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    _sync(device)
    t = time.perf_counter()
    made = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        ids, mask = _left_pad(chunk, pad, dev)
        extra = {} if names is None else {"adapter_names": names[start : start + batch]}
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, **extra
            )
        made += (out.shape[1] - ids.shape[1]) * len(chunk)
    _sync(device)
    return made / (time.perf_counter() - t)


def add_adapters(model, count: int, rank: int):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS)
    peft_model = get_peft_model(model, cfg, adapter_name="a0")
    for i in range(1, count):
        peft_model.add_adapter(f"a{i}", cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for module in peft_model.modules():
            for lin in getattr(module, "lora_B", {}).values():
                lin.weight.normal_(std=0.01)
    return peft_model.eval()


def main() -> None:
    from hf_paged import Engine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tinyllama-1.1b", choices=SHAPES)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=64, help="0: no transformers + peft run")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add_engine_options(parser)
    args = parser.parse_args()
    opts = engine_options(args)
    model = build_model(args.shape, getattr(torch, args.dtype), args.device)
    vocab = model.config.vocab_size
    prompts = w1_prompts(vocab, seed=0)[: args.requests]
    one = [torch.randint(3, vocab, (128,), generator=torch.Generator().manual_seed(1)).tolist()]
    n, new = len(prompts), args.new_tokens
    rows = []

    eng = Engine(model, **opts)
    base = run(eng, prompts, [None] * n, new, args.device)
    base1 = run(eng, one, [None], 2 * new, args.device)
    eng.shutdown()
    rows.append(("base model", base, 1.0))

    model = add_adapters(model, args.adapters, args.rank)
    eng = Engine(model, **{"max_loras": max(8, args.adapters), **opts})
    single = run(eng, prompts, ["a0"] * n, new, args.device)
    rows.append(("1 adapter", single, single / base))
    spread = [f"a{i % args.adapters}" for i in range(n)]
    many = run(eng, prompts, spread, new, args.device)
    rows.append((f"{args.adapters} adapters, uniform", many, many / base))
    lora1 = run(eng, one, ["a0"], 2 * new, args.device)
    eng.shutdown()
    hf = []
    if args.hf_batch > 0:
        model.set_adapter("a0")
        hf.append(
            ("1 adapter", single, run_hf(model, prompts, None, new, args.hf_batch, args.device))
        )
        mixed = ["__base__" if n is None else n for n in spread]
        hf.append(
            (
                f"{args.adapters} adapters",
                many,
                run_hf(model, prompts, mixed, new, args.hf_batch, args.device),
            )
        )

    print(
        f"{args.shape} {args.dtype} {args.device}, {n} requests x {new} new tokens, "
        f"rank {args.rank} on {len(PROJECTIONS)} projections, options {opts}"
    )
    print("| run | output tok/s | / base |")
    print("| --- | ---: | ---: |")
    for name, tps, ratio in rows:
        print(f"| {name} | {tps:,.0f} | {ratio:.1%} |")
    print(f"| batch 1, base | {base1:,.1f} | 100.0% |")
    print(f"| batch 1, 1 adapter | {lora1:,.1f} | {lora1 / base1:.1%} |")
    if hf:
        print(f"\ntransformers + peft generate, static batches of {args.hf_batch}")
        print("| run | hf_paged tok/s | transformers + peft tok/s | ratio |")
        print("| --- | ---: | ---: | ---: |")
        for name, ours, theirs in hf:
            print(f"| {name} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
