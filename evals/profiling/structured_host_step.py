"""The step loop's host time per decode step with grammar-constrained rows, forward stubbed.

    python evals/profiling/structured_host_step.py [--running 256] [--steps 40] [--fraction 1]

--running requests decode under asynchronous scheduling; --fraction of them follow
evals/structured_bench.py's LONG_SCHEMA over its in-memory 32,000-id byte-level BPE (the H200
benchmark's set-up), the rest are plain greedy. A one-layer, 64-wide Llama with that vocabulary
stands in for the model, its forward replaced by a zero-logits stub.

On a CPU the stub and the sampler's tensor work (the mask kernel, the argmax over [rows, 32000])
run on the host, where on a GPU they are device work; they are timed and taken out:
"step loop" is step() minus that work, what the host's thread spends per step; with asynchronous
scheduling it overlaps the GPU's forward, so it costs throughput only where it exceeds the GPU's
time per step, or where the GPU waits for a part of it (ModelRunner._defer_sampling has the
order). "grammar prepare" is the matchers' accept and the bitmask fill, part of the step loop.
The phases are found by name, so the script also measures older versions of the engine (where
the sampler's apply() prepared the bitmask too).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import bench_setup
import torch
from bench_setup import time_calls
from hf_paged_evals.structured_bench import LONG_SCHEMA, bench_tokenizer


def measure(running: int, steps: int, fraction: float, prompt_len: int = 64) -> dict[str, float]:
    import xgrammar

    from hf_paged import Engine, SamplingParams, StructuredOutputs
    from hf_paged.gc_freeze import frozen_heap
    from hf_paged.sample.sampler import Sampler
    from hf_paged.structured_output import logits_mask

    vocab = 32000
    tok = bench_tokenizer(vocab)
    engine = Engine(
        bench_setup.host_model(vocab), tok, max_num_seqs=running, num_blocks=4000,
        async_scheduling=True,
    )  # fmt: skip
    budget = steps + 20
    plain = SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True)
    guided = SamplingParams(
        max_tokens=budget, temperature=0, structured=StructuredOutputs(json=LONG_SCHEMA)
    )
    for i in range(running):
        g = int((i + 1) * fraction) > int(i * fraction)
        engine.add_request([(7 * i + j) % 500 + 3 for j in range(prompt_len)], (plain, guided)[g])
    engine.step()  # admits the requests (added from outside a step, they wait in its inbox)
    while (
        engine.scheduler.waiting
        or engine.scheduler.compiling
        or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
    ):
        engine.step()  # compile and prefill with the real model
    buffers = [torch.zeros(running, vocab) for _ in range(2)]
    flip = [0]
    spent: dict = defaultdict(float)

    def stub(ids, pos, keep):  # the forward's stand-in: zero logits, in reused buffers
        t = time.perf_counter()
        flip[0] ^= 1
        out = buffers[flip[0]][: keep.shape[0]].zero_()  # (a fresh tensor page-faults)
        spent[("forward stub", True)] += time.perf_counter() - t
        return out

    engine.runner.forward = stub
    for _ in range(5):
        engine.step()
    spent.clear()
    time_calls(Sampler, "__call__", "sampler", spent)
    time_calls(xgrammar, "apply_token_bitmask_inplace", "kernel", spent)
    time_calls(logits_mask.GrammarBitmask, "apply", "mask apply", spent)
    for name in ("prepare", "run"):
        if hasattr(logits_mask.GrammarBitmask, name):
            time_calls(logits_mask.GrammarBitmask, name, name, spent)
    if hasattr(logits_mask, "EarlyMask"):  # the helper thread's job, gathered and finished here
        time_calls(logits_mask.GrammarBitmask, "gather", "gather", spent)
        time_calls(logits_mask.GrammarBitmask, "finish", "finish", spent)
        time_calls(logits_mask.EarlyMask, "result", "result", spent)
    first = engine.core.num_steps
    with frozen_heap():
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t
    engine.check_invariants()
    if engine.core.num_steps - first != steps or len(engine.scheduler.running) != running:
        raise RuntimeError("the timed steps were not all decode steps of every request")
    if hasattr(logits_mask.GrammarBitmask, "prepare"):
        prepare = spent[("prepare", True)] + spent[("prepare", False)]
        in_sampler = 0.0  # the runner prepares a deferred step's bitmask before the sampler
    else:  # the older sampler hook: apply() was accept + fill + the kernel
        prepare = in_sampler = spent[("mask apply", True)] - spent[("kernel", True)]
    device_work = spent[("sampler", True)] - in_sampler + spent[("forward stub", True)]
    ms = 1e3 / steps
    out = {
        "step()": total * ms,
        "forward stub + sampler tensor work (device work on a GPU)": device_work * ms,
        "step loop (step() minus that)": (total - device_work) * ms,
        "of which grammar prepare (accept + fill)": prepare * ms,
    }
    if hasattr(logits_mask, "EarlyMask"):
        # prepare() above counts only steps that ran it in line (a row's first sampling)
        on_loop = spent[("gather", True)] + spent[("result", True)] + spent[("run", True)]
        out["of which grammar on the step loop (gather, wait, finish)"] = on_loop * ms
        out["  of which gather"] = spent[("gather", True)] * ms
        out["  of which finish"] = spent[("finish", True)] * ms
        out["grammar's xgrammar calls on the helper thread"] = spent[("run", False)] * ms
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fraction", type=float, default=1.0, help="constrained share of requests")
    args = p.parse_args()
    result = measure(args.running, args.steps, args.fraction)
    print(
        f"host time per decode step, {args.running} running requests, {args.fraction:.0%} "
        f"constrained to LONG_SCHEMA, forward stubbed ({torch.get_num_threads()} threads):"
    )
    for name, value in result.items():
        print(f"  {name:58s} {value:8.3f} ms")


if __name__ == "__main__":
    main()
