"""The runner's start-up paths that normally run only on CUDA (worker/startup.py), driven on the
CPU with torch.cuda's memory queries stubbed: KV-cache sizing from a profiling forward, and the
attention-kernel warm-up (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams
from hf_paged.worker.startup import _profile_cuda_num_blocks, warm_up_kernels

MiB = 2**20


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 100 * MiB)  # peak
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (900 * MiB, 1000 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 60 * MiB)


def test_kv_cache_sized_from_profiling_forward(tiny_model, fake_cuda_memory):
    engine = Engine(tiny_model("llama"), max_num_batched_tokens=300, gpu_memory_utilization=0.5)
    per_block = engine.runner.kv_spec.bytes_per_block
    r = engine.runner
    blocks = _profile_cuda_num_blocks(
        engine.config, r.kv_spec, r.device, r.forward, r.backend, per_block
    )
    # 50% of 1000 MiB, less the forward's peak (100) and non-torch memory (100 - 60 = 40)
    assert blocks == (500 * MiB - 100 * MiB - 40 * MiB) // per_block
    engine.config.gpu_memory_utilization = 0.1
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _profile_cuda_num_blocks(
            engine.config, r.kv_spec, r.device, r.forward, r.backend, per_block
        )


def _record_attention(engine, monkeypatch, what) -> list:
    """what(meta) of every paged-attention call the engine's backend makes from now on."""
    seen = []
    real = engine.runner.backend.paged_attention

    def recording(q, kc, vc, meta, *a, **kw):
        seen.append(what(meta))
        return real(q, kc, vc, meta, *a, **kw)

    monkeypatch.setattr(engine.runner.backend, "paged_attention", recording)
    return seen


def _shortest_query(meta) -> int:
    starts = meta.query_start_loc_host
    return min(b - a for a, b in zip(starts, starts[1:]))


def test_kernel_warm_up_runs_every_variant(tiny_model, monkeypatch):
    from hf_paged import kernels

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    engine = Engine(tiny_model("llama", num_hidden_layers=1), attention_backend="triton")
    assert engine.runner.forward.small_batch is not None  # its decodes take decode_attention
    seen = _record_attention(
        engine, monkeypatch, lambda m: (m.max_query_len, m.max_seq_len, _shortest_query(m))
    )
    decode_lens = []
    real = kernels.decode_attention
    monkeypatch.setattr(
        kernels,
        "decode_attention",
        lambda q, kc, vc, meta, *a, **kw: (
            decode_lens.append(meta.max_seq_len) or real(q, kc, vc, meta, *a, **kw)
        ),
    )
    before = [c.clone() for pair in engine.runner.kv_caches for c in pair]
    warm_up_kernels(
        engine.runner.forward,
        engine.runner.kv_caches,
        engine.runner.backend,
        engine.config,
        engine.runner.device,
    )
    # prefill tiles and decode tiles; short contexts and the longest the engine allows (split-KV)
    assert {q for q, _, _ in seen} == {1, 64}
    assert min(s for _, s, _ in seen) < 16
    assert max(s for _, s, _ in seen) == engine.config.max_model_len
    # prefill-only batches (no decode-sized query: the kernel skips its short-query filter) too
    assert any(shortest == 64 for _, _, shortest in seen)
    # the small-batch forward's decodes: a short context, and the longest (split KV)
    assert min(decode_lens) < 16 and max(decode_lens) == engine.config.max_model_len
    after = [c for pair in engine.runner.kv_caches for c in pair]
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # slots -1: nothing written


def test_kernel_warm_up_runs_each_shape_on_an_adapter_too(peft_model, monkeypatch):
    # a PeftModel's LoRA shrink/expand variants compile at start-up: every warm-up shape runs
    # once without and once with every token on slot 0, plus a prefill past the kernels' 256-token
    # tile; nothing is written to the cache
    from hf_paged.lora import layers

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    engine = Engine(peft_model(), attention_backend="triton", max_model_len=512)
    calls = []
    real = layers.lora_add_

    def recording(y, x, a, b, scale):
        ctx = layers.get_forward_context()
        batch = ctx.lora_groups
        calls.append(None if batch is None else batch.token_slots.tolist())
        return real(y, x, a, b, scale)

    monkeypatch.setattr(layers, "lora_add_", recording)
    before = [c.clone() for pair in engine.runner.kv_caches for c in pair]
    r = engine.runner
    warm_up_kernels(r.forward, r.kv_caches, r.backend, engine.config, r.device, lora=True)
    on_adapter = [c for c in calls if c is not None]
    assert on_adapter and all(set(c) == {0} for c in on_adapter)
    assert len(on_adapter) == len(calls) - len(on_adapter)  # each shape both ways
    assert max(len(c) for c in on_adapter) > 256
    after = [c for pair in engine.runner.kv_caches for c in pair]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_step_metadata_carries_the_shortest_query(tiny_model, monkeypatch):
    # computed once per step on the host; the Triton wrapper reads it instead of scanning the
    # query starts in every layer
    engine = Engine(tiny_model("llama", num_hidden_layers=1), attention_backend="torch")
    seen = _record_attention(engine, monkeypatch, lambda m: (m.min_query_len, _shortest_query(m)))
    engine.generate([[5] * 7, [6] * 30, [7] * 3], SamplingParams(max_tokens=4, temperature=0))
    assert seen and all(got == want for got, want in seen)
    assert {want for _, want in seen} >= {1, 3}
