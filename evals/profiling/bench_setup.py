"""What the profiling scripts share: the evals package, model shapes, the H200's ceilings, timing
and the engine options as command-line flags.

Each script in this folder runs as `python evals/profiling/NAME.py --flag value ...` and imports
this module first. The evals folder is loaded as the package `hf_paged_evals` (evals/run.py's
load_package), never put on sys.path.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import types
from pathlib import Path

import torch

EVALS = Path(__file__).resolve().parents[1]


def load_evals() -> types.ModuleType:
    """evals/ as the package hf_paged_evals (idempotent)."""
    if "hf_paged_evals" in sys.modules:
        return sys.modules["hf_paged_evals"]
    spec = importlib.util.spec_from_file_location("hf_paged_evals_run", EVALS / "run.py")
    run_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_py)
    return run_py.load_package()


load_evals()
from hf_paged_evals import models, roofline, workloads  # noqa: E402

# The H200's ceilings, measured there (one source: evals/roofline.py): ~4.2 TB/s copy and
# ~775 TFLOP/s bf16 dense matmul.
PEAK_BW = roofline.H200.bandwidth
PEAK_FLOPS = roofline.H200.flops
SHAPES = tuple(models.SHAPES)  # --shape: model shapes built with random weights


def build_model(
    shape: str, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", layers: int | None = None
):
    """A model of a named shape (evals/models.py) with random weights: speed does not depend on
    weight values. layers: fewer decoder layers (CPU smoke runs)."""
    return models.build_random_model(shape, dtype, torch.device(device), layers)


def host_model(vocab_size: int) -> torch.nn.Module:
    """A one-layer tiny Llama whose forward costs next to nothing: what is left of a step is the
    engine's host work (host_overhead.py, structured_host_step.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(cfg).eval()


def time_calls(owner, name: str, key: str, spent: dict, calls: dict | None = None) -> None:
    """Wrap owner.name (a function, method or staticmethod; nothing if owner lacks it, as an
    older engine may) so that its wall seconds add to spent[(key, called on the main thread)]
    and, with calls, its calls to calls[(key, ...)]: parts of a step by thread."""
    import inspect
    import threading
    import time

    fn = getattr(owner, name, None)
    if fn is None:
        return
    main = threading.main_thread()

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            where = (key, threading.current_thread() is main)
            spent[where] += time.perf_counter() - t
            if calls is not None:
                calls[where] += 1

    if isinstance(inspect.getattr_static(owner, name), staticmethod):
        timed = staticmethod(timed)
    setattr(owner, name, timed)


def w1_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """W1's prompts, from the harness's own workload definition (evals/workloads.py)."""
    return [r.prompt_token_ids for r in workloads.synthetic(vocab_size, seed=seed).requests]


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a flag (--small-batch-rows 0, --compile 0, ...); unset flags
    keep the engine's defaults. Booleans take 0 or 1."""
    from hf_paged.config import EngineConfig

    group = parser.add_argument_group("engine options (default: the engine's own)")
    for field in dataclasses.fields(EngineConfig):
        kind = str(field.type)
        if "bool" in kind:
            convert = _bool
        elif "int" in kind:
            convert = int
        elif "float" in kind:
            convert = float
        else:
            convert = str
        group.add_argument(f"--{field.name.replace('_', '-')}", type=convert, default=None)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options set on the command line, as Engine keyword arguments."""
    from hf_paged.config import EngineConfig

    names = [f.name for f in dataclasses.fields(EngineConfig)]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _bool(text: str) -> bool:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"expected 0 or 1, got {text!r}")
    return text == "1"


def bench_graph(fn, budget_ms: float = 150.0) -> float:
    """Median milliseconds of CUDA-graph replays of fn, L2 flushed before each (not timed).

    Decode steps run from CUDA graphs in the engine, so this is the time that matters there; it
    also keeps Python launch overhead out of kernel-vs-kernel comparisons.
    """
    flush = torch.empty(256 * 1024**2 // 4, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    graph.replay()
    t1.record()
    torch.cuda.synchronize()
    reps = int(min(100, max(5, budget_ms / max(t0.elapsed_time(t1), 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    del graph
    return times[len(times) // 2]


def gpu_busy_us(events) -> float:
    """Microseconds the GPU was busy: the union of the profiler's kernel intervals (kernels of
    several streams overlap)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def kernel_rows(events, steps: int, top: int = 25) -> str:
    """The profiler's kernels by total time: launches and microseconds per step."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    text = "\n  launches/step  us/step  kernel"
    for name, times in rows:
        text += f"\n  {len(times) / steps:13.1f} {sum(times) / steps:8.1f}  {name[:90]}"
    return text


# the projections a benchmark adapter targets: all seven of a Llama layer
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_adapters(model, count: int, rank: int):
    """A PeftModel of model with count LoRA adapters a0, a1, ... of this rank on PROJECTIONS,
    their B matrices random (peft starts them at zero: an adapter that changes nothing)."""
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
