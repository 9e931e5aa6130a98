"""Host (CPU) time per decode step, split by phase, with the model's forward stubbed out.

    python evals/profiling/host_overhead.py [--running 256] [--steps 100] [--freeze 0]
        [--adapters N]

What the step loop costs the host whatever the model: scheduling, input preparation, the output
update and building RequestOutputs. With asynchronous scheduling this work overlaps the GPU's,
so it bounds the step time only when it exceeds the GPU time per step (evals/RESULTS.md has both
for the TinyLlama-1.1B shape on the H200). A one-layer, 64-wide Llama
stands in for the model (its forward is replaced by a zero-logits stub); runs on CPU.

Also reported: the slowest step and the garbage collections during the timed steps. They run
inside hf_paged.gc_freeze.frozen_heap(), as Engine.generate does; --freeze 0 runs them without it,
to show what full collections of the pre-run heap cost. --adapters N: the stand-in is a PeftModel
with N rank-4 LoRA adapters on every projection, the requests spread over them in turn (what a
multi-LoRA engine's step adds on the host: each token's adapter slot, the step's LoRA batch).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import time

import bench_setup
import torch

PHASES = {  # phase -> (what owns it: an attribute of the engine, or a module; the function)
    "schedule": ("scheduler", "schedule"),
    "prepare inputs": ("hf_paged.worker.model_runner", "prepare_inputs"),
    "execute (incl. prepare)": ("runner", "execute"),
    "update": ("scheduler", "update_from_output"),
    "outputs (incl. update)": ("core", "_after_execute"),
}


def measure(
    running: int = 256,
    steps: int = 100,
    prompt_len: int = 200,
    freeze: bool = True,
    adapters: int = 0,
) -> dict[str, float]:

    from hf_paged import Engine, SamplingParams
    from hf_paged.gc_freeze import frozen_heap

    model = bench_setup.host_model(512)
    if adapters:
        model = bench_setup.add_adapters(model, adapters, rank=4)
    engine = Engine(model, max_num_seqs=running, num_blocks=20000)
    for i in range(running):
        params = SamplingParams(
            max_tokens=steps + 50, temperature=0, ignore_eos=True,
            adapter=f"a{i % adapters}" if adapters else None,
        )  # fmt: skip
        engine.add_request([(7 * i + j) % 500 + 3 for j in range(prompt_len)], params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # prefill with the real model
    engine.runner.forward = lambda ids, pos, keep: torch.zeros(keep.shape[0], 512)
    for _ in range(5):
        engine.step()
    spent = dict.fromkeys(PHASES, 0.0)
    for phase, (owner, name) in PHASES.items():
        obj = importlib.import_module(owner) if "." in owner else getattr(engine, owner)
        fn = getattr(obj, name)

        def timed(*a, _fn=fn, _phase=phase, **k):
            t = time.perf_counter()
            out = _fn(*a, **k)
            spent[_phase] += time.perf_counter() - t
            return out

        setattr(obj, name, timed)
    collections = {0: [], 1: [], 2: []}  # generation -> pause (s) of each collection
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections[info["generation"]].append(time.perf_counter() - started[0])

    slowest = 0.0
    gc.callbacks.append(on_gc)
    heap = frozen_heap() if freeze else contextlib.nullcontext()
    try:
        with heap:  # as Engine.generate does; this loop steps the engine itself
            t = time.perf_counter()
            for _ in range(steps):
                t_step = time.perf_counter()
                engine.step()
                slowest = max(slowest, time.perf_counter() - t_step)
            total = time.perf_counter() - t
    finally:
        gc.callbacks.remove(on_gc)
    result = {"step()": total / steps * 1e3}
    result.update({k: v / steps * 1e3 for k, v in spent.items()})
    result["slowest step"] = slowest * 1e3
    for gen, pauses in collections.items():
        result[f"gen-{gen} collections"] = len(pauses)
        result[f"gen-{gen} collection ms, total"] = sum(pauses) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=256, help="running decode requests")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--freeze", type=int, choices=(0, 1), default=1, help="0: no gc.freeze")
    parser.add_argument("--adapters", type=int, default=0, help="LoRA adapters (0: none)")
    args = parser.parse_args()
    running = args.running
    result = measure(running, args.steps, args.prompt_len, args.freeze == 1, args.adapters)
    cpu = f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    lora = f", {args.adapters} LoRA adapters" if args.adapters else ""
    print(f"host time per decode step, {running} running requests{lora}, forward stubbed ({cpu}):")
    for name, value in result.items():
        unit = "" if name.endswith("collections") else " ms"
        print(f"  {name:32s} {value:8.3f}{unit}")


if __name__ == "__main__":
    main()
