"""Tensor parallelism: output tokens/s at tp=1 and tp=N in the same run, batch 1 and W1.

    python evals/profiling/tp_bench.py --shape llama-3-8b --tp 2             # tp=1 vs tp=2
    python evals/profiling/tp_bench.py --shape llama-3-70b --tp 2 --no-tp1   # too big for one GPU

Random weights in bf16 (speed does not depend on their values), built on the host (filled from a
tiled random block: seconds, not minutes, for a 70B-class shape) and streamed to the ranks'
GPUs by the engine (tensor_parallel_device="cuda"); the tp=1 run moves the model to cuda:0.
Batch 1: one 128-token prompt, 256 new tokens (after a warm-up run). W1: evals/workloads.py's
256 requests. The batch-1 bound is one read of each GPU's weight shard per token at the H200's
copy bandwidth (bench_setup.PEAK_BW); the fraction printed is measured / bound.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_setup import PEAK_BW, SHAPES, add_engine_options, engine_options, models, w1_prompts


def build_host_model(shape: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    kwargs = dict(models.SHAPES[shape])
    arch, theta = kwargs.pop("arch"), kwargs.pop("rope_theta")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = cls(**kwargs, rope_parameters={"rope_type": "default", "rope_theta": theta})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu").eval()
    block = (torch.randn(1 << 20) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            for start in range(0, flat.numel(), block.numel()):
                part = flat[start : start + block.numel()]
                part.copy_(block[: part.numel()])
        rotary = model.model.rotary_emb  # its buffers are computed, not random
        model.model.rotary_emb = type(rotary)(config, device="cpu")
    return model


def run(engine, vocab: int, batch1_tokens: int = 256) -> dict:
    from hf_paged import SamplingParams

    prompt = [list(range(3, 131))]
    one = SamplingParams(max_tokens=batch1_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompt, one)  # warm-up: kernels' first compiles
    t0 = time.perf_counter()
    engine.generate(prompt, one)
    batch1 = batch1_tokens / (time.perf_counter() - t0)
    prompts = w1_prompts(vocab, seed=0)
    w1 = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    engine.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, w1)
    seconds = time.perf_counter() - t0
    return {"batch1": batch1, "w1": sum(len(o.output_token_ids) for o in outs) / seconds}


def main() -> None:
    from hf_paged import Engine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b", choices=SHAPES)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--no-tp1", action="store_true", help="skip the one-GPU run")
    add_engine_options(parser)
    args = parser.parse_args()
    opts = engine_options(args)
    t0 = time.perf_counter()
    model = build_host_model(args.shape)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    print(
        f"{args.shape}: {weight_bytes / 1e9:.1f} GB bf16, built in {time.perf_counter() - t0:.0f} s"
    )
    results = {}
    for tp in ([] if args.no_tp1 else [1]) + [args.tp]:
        t0 = time.perf_counter()
        if tp == 1:
            model.to("cuda:0")
            engine = Engine(model, **opts)
        else:
            model.to("cpu")
            engine = Engine(model, tensor_parallel_size=tp, tensor_parallel_device="cuda", **opts)
        print(f"tp={tp}: start-up {time.perf_counter() - t0:.0f} s")
        try:
            results[tp] = r = run(engine, vocab)
        finally:
            engine.shutdown()
        bound = PEAK_BW / (weight_bytes / tp)
        print(
            f"tp={tp}: batch 1 {r['batch1']:.1f} tok/s ({r['batch1'] / bound:.0%} of the "
            f"{bound:.0f} tok/s weight-read bound), W1 {r['w1']:.0f} tok/s"
        )
    if 1 in results and args.tp in results:
        a, b = results[1], results[args.tp]
        print(
            f"tp={args.tp} / tp=1: batch 1 {b['batch1'] / a['batch1']:.2f}x, "
            f"W1 {b['w1'] / a['w1']:.2f}x"
        )


if __name__ == "__main__":
    main()
