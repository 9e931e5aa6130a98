"""Engine-only W1 and batch-1 benchmark with a per-phase breakdown (no baselines: see run.py).

    python evals/engine_bench.py compile=0 cuda_graphs=1

TinyLlama-1.1B shape, bf16, random weights; W1 = 256 requests, prompts 64-512 random tokens,
256 output tokens, EOS ignored. Warm-up on 8 real-length prompts first (Triton JIT, graphs).
Prints start-up, graph-capture time, output tokens/s and the wall seconds spent in
schedule / execute / update over the run, then batch-1 decode tokens/s.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # evals/kernels.py must not shadow the PyPI `kernels` package

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_paged import Engine, SamplingParams

    opts = dict(arg.split("=") for arg in sys.argv[1:])
    opts = {k: (v == "1") if k in ("compile", "cuda_graphs") else int(v) for k, v in opts.items()}
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    t0 = time.perf_counter()
    eng = Engine(model, **opts)
    print(
        f"startup {time.perf_counter() - t0:.1f}s, graph capture "
        f"{eng.runner.graph_capture_seconds:.1f}s, {eng.kv.num_blocks} KV blocks, "
        f"compiled {eng.runner.compiled}",
        flush=True,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 32000, int(n)).tolist() for n in rng.integers(64, 513, 256)]
    eng.generate(prompts[:8], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))

    spent = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    originals = (eng.scheduler.schedule, eng.runner.execute, eng.scheduler.update_from_output)

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[name] += time.perf_counter() - t
            return out

        return wrapper

    eng.scheduler.schedule = timed("schedule", originals[0])
    eng.runner.execute = timed("execute", originals[1])
    eng.scheduler.update_from_output = timed("update", originals[2])
    steps0 = eng.num_steps
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    n_out = sum(len(o.output_token_ids) for o in outs)
    print(
        f"W1 {opts}: {n_out} tokens in {wall:.2f}s = {n_out / wall:,.0f} output tok/s over "
        f"{eng.num_steps - steps0} steps; seconds in "
        + ", ".join(f"{k} {v:.2f}" for k, v in spent.items())
    )
    eng.scheduler.schedule, eng.runner.execute, eng.scheduler.update_from_output = originals
    torch.cuda.synchronize()
    t = time.perf_counter()
    one = eng.generate(
        [prompts[0][:128]], SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
    )[0]
    torch.cuda.synchronize()
    print(f"batch-1 decode: {len(one.output_token_ids) / (time.perf_counter() - t):,.0f} tok/s")


if __name__ == "__main__":
    main()
