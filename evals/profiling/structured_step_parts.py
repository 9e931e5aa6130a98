"""W1's host time per step by part with none / every request constrained to a JSON schema, the
real model on a GPU: where a constrained step's extra time goes.

    python evals/profiling/structured_step_parts.py [--shape tinyllama-1.1b] [--rounds 2]

Runs W1 (256 requests, 256 greedy tokens) on one engine, unconstrained and then every request
following evals/structured_bench.py's LONG_SCHEMA over its in-memory byte-level BPE (as
`evals/run.py structured-bench` does), --rounds times. Each part is a function of the engine timed
where it is called, summed per step and split by thread (the step loop's, or the grammar's
helper): the scheduler's schedule and update, the runner's execute (and inside it the input
preparation, the sampler, the mask's apply), waiting for a step's tokens (`land` / `wait`), and the
grammar's gather, helper run (xgrammar's batched accept and fill inside it), waiting for the helper
(`result`) and finish. Parts nest, so their sum is more than the step. Averages over every step,
prefill steps included (a prefill step's wait for its tokens is long).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict

import bench_setup
import torch
from bench_setup import time_calls
from hf_paged_evals.structured_bench import LONG_SCHEMA, bench_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tinyllama-1.1b", choices=bench_setup.SHAPES)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    import hf_paged.core.scheduler as scheduler
    import hf_paged.sample.sampler as sampler
    import hf_paged.structured_output.batch_calls as batch_calls
    import hf_paged.structured_output.logits_mask as mask
    import hf_paged.worker.async_output as async_output
    import hf_paged.worker.model_runner as runner
    from hf_paged import Engine, SamplingParams, StructuredOutputs
    from hf_paged.gc_freeze import frozen_heap

    model = bench_setup.build_model(args.shape)
    vocab = model.config.vocab_size
    tok = bench_tokenizer(vocab)
    wl = bench_setup.workloads.synthetic(vocab, seed=0)
    prompts = [r.prompt_token_ids for r in wl.requests]
    n = len(prompts)
    engine = Engine(model, tok, max_num_seqs=n)
    plain = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(
        max_tokens=256, temperature=0.0, eos_token_id=[tok.eos_token_id],
        structured=StructuredOutputs(json=LONG_SCHEMA),
    )  # fmt: skip
    engine.generate(prompts[:8], [plain, guided] * 4)  # compile the grammar, warm up
    spent: dict = defaultdict(float)
    calls: Counter = Counter()
    for owner, name, key in [
        (scheduler.Scheduler, "schedule", "schedule"),
        (scheduler.Scheduler, "update_from_output", "update_from_output"),
        (runner.ModelRunner, "execute", "execute"),
        (runner, "prepare_inputs", "prepare_inputs"),
        (runner.ModelRunner, "_land", "land (incl. wait)"),
        (async_output.PendingOutput, "wait", "wait for tokens"),
        (sampler.Sampler, "__call__", "sampler"),
        (mask.GrammarBitmask, "apply", "mask apply"),
        (mask.GrammarBitmask, "prepare", "grammar prepare (in line)"),
        (mask.GrammarBitmask, "gather", "grammar gather"),
        (mask.GrammarBitmask, "run", "grammar run"),
        (mask.GrammarBitmask, "finish", "grammar finish"),
        (getattr(mask, "EarlyMask", None), "result", "grammar result (incl. wait)"),
        (batch_calls.BatchCalls, "accept", "xgrammar accept"),
        (batch_calls.BatchCalls, "fill", "xgrammar fill"),
    ]:
        if owner is not None:
            time_calls(owner, name, key, spent, calls)
    print(f"{args.shape} bfloat16 on {torch.cuda.get_device_name()}: {wl.summary()}")
    for rnd in range(args.rounds):
        for label, params in (("0%", plain), ("100%", guided)):
            engine.reset_prefix_cache()
            torch.cuda.synchronize()
            spent.clear()
            calls.clear()
            first = engine.core.num_steps
            t = time.perf_counter()
            with frozen_heap():
                outs = engine.generate(prompts, [params] * n)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            steps = engine.core.num_steps - first
            tokens = sum(len(o.output_token_ids) for o in outs)
            print(
                f"\nround {rnd}, {label} constrained: {tokens / wall:,.0f} output tok/s, "
                f"{steps} steps, {wall / steps * 1e3:.2f} ms a step"
            )
            for (key, on_loop), value in sorted(spent.items(), key=lambda kv: -kv[1]):
                where = "step loop" if on_loop else "helper"
                print(
                    f"  {key:30s} {where:9s} {value / steps * 1e3:7.3f} ms/step "
                    f"({calls[(key, on_loop)]} calls)"
                )
    engine.shutdown()


if __name__ == "__main__":
    main()
