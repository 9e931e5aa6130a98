"""Backends that run a Workload and report per-request timings.

  paged  hf_paged.Engine (add_request / step)
  hf     transformers generate in static batches, left padding, EOS off
  hf-cb  transformers' own continuous batching (the manager behind model.generate_batch)

Timing contract, the same for all three: one-time setup (engine construction, KV allocation,
warm-up, CUDA-graph capture) happens before the clock starts; every request of a throughput
workload is submitted at t0 (offline batch), so TTFT includes queueing; a workload with
max_concurrency=1 submits each request when the previous one finished (batch-1 latency).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .errors import EvalError
from .thread_clock import GcPauses
from .workloads import Workload

BACKENDS = ("paged", "hf", "hf-cb")


@dataclass(slots=True)
class RequestTiming:
    prompt_len: int
    output_len: int  # tokens actually generated for the request
    arrival: float  # seconds since t0 (submission)
    first_token: float
    finish: float


@dataclass
class BackendRun:
    backend: str
    concurrency: int
    timings: list[RequestTiming]
    wall_s: float
    peak_memory_bytes: int | None = None
    memory_kind: str = ""
    extra: dict = field(default_factory=dict)  # kv usage, prefix-cache hits, wasted tokens...


def sync(device: torch.device) -> None:
    # Host timestamps are only meaningful once queued GPU work has finished.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _start_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max allocated"
    # ru_maxrss is KiB on Linux and covers the whole process (not reset between backends).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


class _restore_attention:
    """Engines and transformers' CB switch the model's attention implementation; the next
    backend in the same invocation must see the model as loaded."""

    def __init__(self, model) -> None:
        self.model = model
        self.impl = model.config._attn_implementation

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.model.config._attn_implementation != self.impl:
            self.model.set_attn_implementation(self.impl)


def _check_lengths(run: BackendRun, wl: Workload) -> None:
    # the prompts too: row i of the timings is the workload's request i (merged in order)
    order = [t.prompt_len for t in run.timings] == [len(r.prompt_token_ids) for r in wl.requests]
    if not order:
        raise EvalError(f"backend {run.backend}'s timings do not follow the workload's requests")
    bad = [
        (t.output_len, r.max_new_tokens)
        for t, r in zip(run.timings, wl.requests)
        if t.output_len != r.max_new_tokens
    ]
    if bad:
        raise EvalError(
            f"backend {run.backend} generated {bad[0][0]} tokens where "
            f"{bad[0][1]} were asked ({len(bad)} requests differ): EOS not ignored?"
        )


# ------------------------------------------------------------------------------------ paged


def run_paged(
    model, wl: Workload, concurrency: int, engine_options: dict | None = None, progress: bool = True
) -> BackendRun:
    try:
        import hf_paged
        from hf_paged import SamplingParams
        from hf_paged.gc_freeze import frozen_heap
    except ImportError as exc:
        raise EvalError(f"backend paged: cannot import hf_paged ({exc})") from exc
    device = _device(model)
    with _restore_attention(model):
        t_start = time.perf_counter()
        engine = hf_paged.Engine(model, max_num_seqs=concurrency, **(engine_options or {}))
        startup_s = time.perf_counter() - t_start
        # Warm-up outside the clock: a slice of the workload itself, so the Triton kernel
        # variants it needs (prefill tiles, mixed launches, split-KV) are compiled before timing.
        # Measured on the H200: a 2 x 32-token warm-up left that JIT work inside the timed W1 run.
        warm = [r.prompt_token_ids for r in wl.requests[:8]]
        engine.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        if hasattr(engine, "reset_prefix_cache"):
            engine.reset_prefix_cache()  # the warm-up blocks must not count as hits
        stats0 = engine.stats()
        _start_memory(device)
        sync(device)
        t0 = time.perf_counter()
        timings: dict[str, RequestTiming] = {}
        order: list[str] = []
        pbar = tqdm(total=len(wl.requests), desc="paged", unit="req", disable=not progress)
        sequential = wl.max_concurrency == 1
        pending = list(wl.requests)

        def submit(req) -> None:
            params = SamplingParams(max_tokens=req.max_new_tokens, temperature=0.0, ignore_eos=True)
            try:
                rid = engine.add_request(req.prompt_token_ids, params)
            except ValueError as exc:  # e.g. longer than max_model_len or the whole KV cache
                raise EvalError(f"backend paged rejected a request: {exc}") from exc
            order.append(rid)
            timings[rid] = RequestTiming(
                len(req.prompt_token_ids), 0, time.perf_counter() - t0, 0.0, 0.0
            )

        cpu0 = time.thread_time()  # the engine's host work: all of it runs on this thread
        with frozen_heap(), GcPauses() as gc_pauses:  # frozen as Engine.generate freezes it
            while pending or engine.has_unfinished_requests():
                if pending and (not sequential or not engine.has_unfinished_requests()):
                    batch = pending[:1] if sequential else pending
                    for req in batch:
                        submit(req)
                    pending = pending[len(batch) :]
                for out in engine.step():
                    if out.finished:
                        t = timings[out.request_id]
                        t.output_len = len(out.output_token_ids)
                        t.first_token = out.first_token_time - t0
                        t.finish = out.finish_time - t0
                        pbar.update(1)
        sync(device)
        wall = time.perf_counter() - t0
        cpu_s = time.thread_time() - cpu0
        pbar.close()
        stats = engine.stats()
        peak, kind = _peak_memory(device)
        # read before shutdown, which drops the graphs and undoes compile and fusion
        engine_info = {
            "compile": engine.runner.forward.compiled,
            "compile_scope": engine.runner.forward.compile_scope,
            "cuda_graphs": engine.runner.graphs is not None,
            "mixed_step_graphs": len(engine.runner.graphs.token_buckets)
            if engine.runner.graphs is not None
            else 0,
            "async_scheduling": engine.config.async_scheduling,
            "fuse_projections": engine.config.fuse_projections,
            "small_batch_forward": engine.runner.forward.small_batch_status,
            "startup_s": startup_s,
            # the cache's capacity: FP8 caches hold twice the tokens of bf16 ones
            "kv_cache_dtype": str(engine.runner.kv_spec.dtype).removeprefix("torch."),
            "kv_tokens": engine.kv.num_blocks * engine.config.block_size,
            # seconds per start-up phase (hf_paged/worker/startup_times.py)
            "startup": getattr(engine, "startup_stats", None),
        }

        # the KV cache and any fused projections must not outlive this backend's run: the
        # baselines that follow get the model (and the memory) as loaded
        engine.shutdown()
    queries = stats.get("prefix_cache_queries", 0) - stats0.get("prefix_cache_queries", 0)
    hits = stats.get("prefix_cache_hits", 0) - stats0.get("prefix_cache_hits", 0)
    extra = {
        "kv_blocks": stats.get("num_blocks"),
        "kv_peak_blocks_used": stats.get("peak_blocks_used"),
        "kv_usage": (
            stats["peak_blocks_used"] / stats["num_blocks"]
            if stats.get("num_blocks") and "peak_blocks_used" in stats
            else None
        ),
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "num_preemptions": stats.get("num_preemptions", 0) - stats0.get("num_preemptions", 0),
        "num_steps": stats.get("num_steps", 0) - stats0.get("num_steps", 0),
        "cpu_s": cpu_s,  # this thread's CPU seconds in the timed run (the engine's host work)
        "gc": gc_pauses.as_dict(),  # collections in the timed run, by thread
        "engine_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
        "engine": engine_info,
    }
    run = BackendRun("paged", concurrency, [timings[r] for r in order], wall, peak, kind, extra)
    _check_lengths(run, wl)
    return run


# ------------------------------------------------------------------------------- hf static


class _StepClock:
    """A stopping criterion that never stops: it timestamps every decoding step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        sync(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _pad_id(model) -> int:
    gc = model.generation_config
    for tok in (gc.pad_token_id, gc.eos_token_id, model.config.pad_token_id):
        if isinstance(tok, list):
            tok = tok[0] if tok else None
        if tok is not None:
            return int(tok)
    return 0


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def hf_generate_config(model, max_new_tokens: int):
    """Greedy, EOS off: eos_token_id=None makes generate run exactly max_new_tokens steps
    (min_new_tokens would also work but masks the EOS logit, changing greedy choices)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=_pad_id(model),
        use_cache=True,
    )


def run_hf(model, wl: Workload, batch_size: int, progress: bool = True) -> BackendRun:
    from transformers import StoppingCriteriaList

    device = _device(model)
    pad = _pad_id(model)
    size = 1 if wl.max_concurrency == 1 else batch_size
    with torch.inference_mode():
        ids, mask = _left_pad([[17] * 16], pad, device)  # warm-up outside the clock
        model.generate(
            input_ids=ids, attention_mask=mask, generation_config=hf_generate_config(model, 2)
        )
    _start_memory(device)
    sync(device)
    t0 = time.perf_counter()
    timings: list[RequestTiming] = []
    generated = 0
    pbar = tqdm(total=len(wl.requests), desc="hf", unit="req", disable=not progress)
    for start in range(0, len(wl.requests), size):
        chunk = wl.requests[start : start + size]
        # Static batching: the batch runs to its longest request; shorter ones' extra tokens are
        # computed but not counted as useful output (vLLM's hf backend counts the same way).
        steps = max(r.max_new_tokens for r in chunk)
        arrival = 0.0 if size > 1 else time.perf_counter() - t0
        clock = _StepClock(device)
        ids, mask = _left_pad([r.prompt_token_ids for r in chunk], pad, device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=hf_generate_config(model, steps),
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        made = out.shape[1] - ids.shape[1]
        if made != steps or len(clock.times) != steps:
            raise EvalError(f"backend hf generated {made} tokens where {steps} were asked")
        generated += made * len(chunk)
        for r in chunk:
            timings.append(
                RequestTiming(
                    len(r.prompt_token_ids),
                    r.max_new_tokens,
                    arrival,
                    clock.times[0] - t0,
                    clock.times[r.max_new_tokens - 1] - t0,
                )
            )
        pbar.update(len(chunk))
    sync(device)
    wall = time.perf_counter() - t0
    pbar.close()
    peak, kind = _peak_memory(device)
    extra = {
        "wasted_tokens": generated - wl.num_output_tokens,
        "kv_usage": None,
        "prefix_cache_hit_rate": None,
    }
    run = BackendRun("hf", size, timings, wall, peak, kind, extra)
    _check_lengths(run, wl)
    return run


# ---------------------------------------------------------------------------------- hf-cb


def run_hf_cb(model, wl: Workload, concurrency: int | None, progress: bool = True) -> BackendRun:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    device = _device(model)
    # eos_token_id=-1 is transformers' own "EOS disabled" (None falls back to the model's).
    gen = GenerationConfig(
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=_pad_id(model),
        max_new_tokens=max(r.max_new_tokens for r in wl.requests),
    )
    cb_options = {}
    if wl.max_concurrency == 1:
        concurrency = 1
    if concurrency:
        cb_options["max_requests_per_batch"] = concurrency
    if device.type == "cpu":
        # On the host transformers sizes the cache from free RAM (~8 GB here); the whole
        # workload's tokens fit in far less, and CI machines have 2 cores and little RAM.
        page = 256
        cb_options["num_blocks"] = (
            sum(-(-(len(r.prompt_token_ids) + r.max_new_tokens) // page) for r in wl.requests) + 2
        )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in wl.requests),
        max_generated_length=gen.max_new_tokens,
        num_requests=len(wl.requests),
    )
    timings: dict[str, RequestTiming] = {}
    order: list[str] = []
    with _restore_attention(model), torch.inference_mode():
        ctx = model.continuous_batching_context_manager(
            generation_config=gen,
            continuous_batching_config=ContinuousBatchingConfig(**cb_options),
            block=True,
            timeout=5,
            warmup=True,
            workload_hints=hints,
        )
        with ctx as manager:  # warm-up (graph capture) happens on entry, outside the clock
            # The concurrency transformers resolved (workload hints, memory), for the report.
            resolved = getattr(manager.continuous_batching_config, "max_requests_per_batch", None)
            concurrency = concurrency or resolved
            _start_memory(device)
            sync(device)
            t0 = time.perf_counter()
            pbar = tqdm(total=len(wl.requests), desc="hf-cb", unit="req", disable=not progress)
            sequential = wl.max_concurrency == 1
            pending = list(enumerate(wl.requests))
            done = 0
            while done < len(wl.requests):
                if pending and (not sequential or done == len(order)):
                    batch = pending[:1] if sequential else pending
                    for i, req in batch:
                        rid = manager.add_request(
                            req.prompt_token_ids,
                            request_id=f"r{i}",
                            max_new_tokens=req.max_new_tokens,
                            record_timestamps=True,
                            eos_token_id=-1,
                        )
                        order.append(rid)
                        timings[rid] = RequestTiming(
                            len(req.prompt_token_ids), 0, time.perf_counter() - t0, 0.0, 0.0
                        )
                    pending = pending[len(batch) :]
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise EvalError("backend hf-cb: the generation thread stopped")
                    continue
                if not result.is_finished():
                    continue
                if result.error is not None:
                    raise EvalError(f"backend hf-cb: request failed: {result.error}")
                t = timings[result.request_id]
                t.output_len = len(result.generated_tokens)
                stamps = result.timestamps or [result.lifespan[1]]
                t.first_token = stamps[0] - t0
                t.finish = stamps[-1] - t0
                done += 1
                pbar.update(1)
            sync(device)
            wall = time.perf_counter() - t0
            pbar.close()
            peak, kind = _peak_memory(device)
    extra = {"kv_usage": None, "prefix_cache_hit_rate": None, "cb_config": cb_options}
    run = BackendRun(
        "hf-cb", concurrency or 0, [timings[r] for r in order], wall, peak, kind, extra
    )
    _check_lengths(run, wl)
    return run


def run_backend(
    name: str,
    model,
    wl: Workload,
    concurrency: int | None,
    progress: bool = True,
    engine_options: dict | None = None,
) -> BackendRun:
    if wl.max_concurrency:
        concurrency = min(concurrency or wl.max_concurrency, wl.max_concurrency)
    if name == "paged":
        return run_paged(model, wl, concurrency, engine_options, progress)
    if name == "hf":
        return run_hf(model, wl, concurrency, progress)
    if name == "hf-cb":
        return run_hf_cb(model, wl, concurrency, progress)
    raise EvalError(f"unknown backend {name!r}: use {', '.join(BACKENDS)}")
