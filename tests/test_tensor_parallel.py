"""Tensor parallelism on the CPU: 2 gloo processes (rank 0 is the test's own), float32.

Greedy output with tensor_parallel_size=2 equals transformers' generate and the one-process
engine (Llama: KV heads split; Qwen2: one KV head replicated on both ranks, tied embeddings,
q/k/v biases); options and models that cannot be split are refused with the field named; a
killed rank ends the run with an error within a bounded time; the model comes back unchanged.
Each engine start spawns one worker process (a Python start-up with torch and transformers)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import hf_paged

if (os.cpu_count() or 1) < 2:
    pytest.skip("tensor parallelism on the CPU needs 2 cores", allow_module_level=True)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 70)), [3, 200, 17, 45]]
# a prompt longer than the token budget: chunked prefill; four requests: batched steps
OPTIONS = dict(max_num_batched_tokens=24, num_blocks=64, block_size=8)


def _reference(model, prompts, max_new_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
        out.append(ids[0, len(p) :].tolist())
    return out


def _generate(engine, prompts, params) -> list[list[int]]:
    return [list(o.output_token_ids) for o in engine.generate(prompts, params)]


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {}),
        ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    ],
)
def test_greedy_tp2_equals_transformers_and_tp1(arch, overrides, tiny_model):
    model = tiny_model(arch, **overrides)
    before = _snapshot(model)
    greedy = hf_paged.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    # n = 2 forks a request: copy-on-write of its last block on every rank
    sampled = hf_paged.SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=7, ignore_eos=True)
    expected = _reference(model, PROMPTS, 10)
    one = hf_paged.Engine(model, **OPTIONS)
    assert _generate(one, PROMPTS, greedy) == expected
    one_sampled = _generate(one, PROMPTS[:2], sampled)
    one.shutdown()

    engine = hf_paged.Engine(model, tensor_parallel_size=2, **OPTIONS)
    try:
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.out_features == 64 // 2  # this rank's heads only
        assert engine.verify_error is not None and engine.verify_error < 1e-4
        assert _generate(engine, PROMPTS, greedy) == expected
        assert _generate(engine, PROMPTS[:2], sampled) == one_sampled
        engine.check_invariants()
    finally:
        engine.shutdown()
    assert not dist.is_initialized()
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert _reference(model, PROMPTS[:1], 10) == expected[:1]


@pytest.mark.parametrize(
    "arch, overrides, options, field",
    [
        ("llama", {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}, {},
         "num_attention_heads=3"),
        ("llama", {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3}, {},
         "num_key_value_heads=3"),
        ("llama", {"intermediate_size": 129}, {}, "intermediate_size=129"),
        ("llama", {}, {"tensor_parallel_size": 4096}, "exceeds the"),
        ("llama", {}, {"tensor_parallel_device": "cuda", "tensor_parallel_size": 4096},
         "4096 exceeds the .* cuda devices"),
        ("llama", {}, {"compile": True}, "compile=True"),
        ("llama", {}, {"quantization": "fp8"}, "quantization='fp8'"),
        ("llama", {}, {"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype='bfloat16'"),
        ("gpt_neox", {}, {}, "query_key_value"),  # a fused qkv: its rows' layout is its own
        ("phi3", {}, {}, "rowwise_split_input"),  # fused qkv, a style of its own
    ],
)  # fmt: skip
def test_refused_before_anything_starts(arch, overrides, options, field, tiny_model):
    model = tiny_model(arch, **overrides)
    before = _snapshot(model)
    options = {"tensor_parallel_size": 2, **options}
    with pytest.raises(ValueError, match=field):
        hf_paged.Engine(model, **options)
    assert not dist.is_initialized()
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert model.config._attn_implementation != "hf_paged"


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_tensor_parallel_size(value, tiny_model):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        hf_paged.Engine(tiny_model("llama"), tensor_parallel_size=value)


def test_bad_tensor_parallel_device(tiny_model):
    with pytest.raises(ValueError, match="tensor_parallel_device"):
        hf_paged.Engine(tiny_model("llama"), tensor_parallel_size=2, tensor_parallel_device="tpu")


def _run_bounded(fn, seconds: float):
    """fn() in a thread; (its exception or None, seconds taken); fails if it runs past."""
    box = {}

    def target():
        try:
            fn()
        except BaseException as exc:
            box["exc"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a hang"
    return box.get("exc"), time.monotonic() - t0


def test_a_killed_rank_ends_the_run_with_an_error(tiny_model):
    model = tiny_model("llama")
    before = _snapshot(model)
    engine = hf_paged.Engine(model, tensor_parallel_size=2, **OPTIONS)
    try:
        executor = engine.runner.tp
        worker = executor.procs[0]
        long = hf_paged.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        # killed while rank 0 steps: it waits in a broadcast or an all-reduce at that moment
        threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
        exc, seconds = _run_bounded(lambda: engine.generate([PROMPTS[2]] * 4, long), 60)
        assert isinstance(exc, RuntimeError), exc
        assert "tensor parallel" in str(exc)
        worker.join(10)
        assert worker.exitcode == -signal.SIGKILL
        # every later step says so at once
        greedy = hf_paged.SamplingParams(max_tokens=4, temperature=0)
        exc, seconds = _run_bounded(lambda: engine.generate(PROMPTS[:1], greedy), 10)
        assert isinstance(exc, RuntimeError) and "rank 1 exited" in str(exc), exc
    finally:
        engine.shutdown()
    assert not dist.is_initialized()
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
