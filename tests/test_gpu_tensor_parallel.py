"""Tensor parallelism on 2 GPUs (NCCL): the same checks as tests/test_tensor_parallel.py on the
CPU, on CUDA. Needs 2 GPUs: `pytest -m gpu tests/test_gpu_tensor_parallel.py` on the x2 machine."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import hf_paged

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 70)), [3, 200, 17, 45]]


def _reference(model, prompts, max_new_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize(
    "arch, overrides",
    [("llama", {}), ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True})],
)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_greedy_tp2_on_cuda_equals_transformers(arch, overrides, backend, tiny_model):
    model = tiny_model(arch, **overrides).to("cuda:0")
    expected = _reference(model, PROMPTS, 12)
    params = hf_paged.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = hf_paged.Engine(
        model, tensor_parallel_size=2, attention_backend=backend, max_num_batched_tokens=24
    )
    try:
        got = [list(o.output_token_ids) for o in engine.generate(PROMPTS, params)]
        engine.check_invariants()
    finally:
        engine.shutdown()
    assert got == expected
    assert not dist.is_initialized()


def test_model_on_the_host_runs_on_the_gpus(tiny_model):
    model = tiny_model("llama")
    expected = _reference(model, PROMPTS, 8)
    params = hf_paged.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine = hf_paged.Engine(model, tensor_parallel_size=2, tensor_parallel_device="cuda")
    try:
        assert engine.runner.device.type == "cuda"
        got = [list(o.output_token_ids) for o in engine.generate(PROMPTS, params)]
    finally:
        engine.shutdown()
    assert got == expected
    assert next(model.parameters()).device.type == "cpu"  # put back where it was


def test_a_killed_rank_is_an_error_on_cuda(tiny_model):
    model = tiny_model("llama").to("cuda:0")
    engine = hf_paged.Engine(model, tensor_parallel_size=2)
    try:
        worker = engine.runner.tp.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            engine.generate(PROMPTS[:1], hf_paged.SamplingParams(max_tokens=4, temperature=0))
        assert time.monotonic() - t0 < 30
    finally:
        engine.shutdown()
    assert not dist.is_initialized()
