"""Architectures that need an attention feature beyond plain causal softmax attention, end to
end: greedy float32 output token-identical to transformers' generate, with the torch backend and
the Triton kernels (interpreted on CPU). Attention sinks: gpt-oss (s_aux). Keys and values of
different head sizes: DeepSeek-V3's MLA as transformers runs it (keys 24, values 16 here), in a
KV cache sized from what the model's attention calls pass."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.worker.startup import KVCacheSpec, LayerKVShape

LENGTHS = [1, 9, 30, 45]  # the 30 and 45 prompts pass gpt-oss's 20-token window


def _generate(model, ids, mask, options=None):
    gen = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    if options is None:
        return model.generate(**gen)
    hf_paged.patch(model, **options)
    try:
        return model.generate(**gen)
    finally:
        hf_paged.unpatch(model)


def _gpt_oss(tiny_model):
    model = tiny_model("gpt_oss")
    with torch.no_grad():  # sinks of the scores' size: they change the answer (checked below)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, layer.self_attn.sinks.numel()))
    return model


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpt_oss_sinks_greedy_parity(backend, tiny_model, batch_factory):
    model = _gpt_oss(tiny_model)
    ids, mask = batch_factory(LENGTHS)
    ref = _generate(model, ids, mask)
    out = _generate(model, ids, mask, {"block_size": 8, "attention_backend": backend})
    assert torch.equal(out, ref)


def test_gpt_oss_sinks_change_the_answer(tiny_model, batch_factory):
    # the parity above would hold for an engine that ignored the sinks, were they too small to
    # matter: with them pushed to -inf's side transformers' own tokens change
    model = _gpt_oss(tiny_model)
    ids, mask = batch_factory(LENGTHS)
    ref = _generate(model, ids, mask)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-30.0)
    assert not torch.equal(_generate(model, ids, mask), ref)


@pytest.mark.parametrize("length", [12, 30])  # inside and past the 20-token window
def test_patched_gpt_oss_called_directly_keeps_its_sinks(length, tiny_model, batch_factory):
    # outside engine steps the attention function falls back to transformers' attention, and
    # sdpa has no sinks: the model's own eager attention must serve this call
    model = _gpt_oss(tiny_model)
    ids, _ = batch_factory([length])
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        hf_paged.patch(model, block_size=8)
        try:
            out = model(input_ids=ids).logits
        finally:
            hf_paged.unpatch(model)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deepseek_v3_mla_greedy_parity(backend, tiny_model, batch_factory):
    model = tiny_model("deepseek_v3")
    ids, mask = batch_factory(LENGTHS)
    ref = _generate(model, ids, mask)
    out = _generate(model, ids, mask, {"block_size": 8, "attention_backend": backend})
    assert torch.equal(out, ref)


def test_kv_cache_geometry_is_what_attention_is_called_with(tiny_model):
    # the config's num_key_value_heads (set to 2 here, as the coverage harness's tiny configs do)
    # is not what MLA attention uses (transformers' own eager forward fails on it: no check)
    model = tiny_model("deepseek_v3", num_key_value_heads=2)
    engine = hf_paged.Engine(model, num_blocks=8, block_size=8, verify_model=False)
    try:
        assert engine.runner.kv_spec.layers == [LayerKVShape(4, 24, 16)] * 2
        for key_cache, value_cache in engine.runner.kv_caches:
            assert key_cache.shape == (8, 8, 4, 24) and value_cache.shape == (8, 8, 4, 16)
        # 2 layers x 8 slots x 4 heads x (24 + 16) x 4 bytes
        assert engine.runner.kv_spec.bytes_per_block == 2 * 8 * 4 * 40 * 4
    finally:
        engine.shutdown()


def test_per_layer_kv_heads(tiny_model, batch_factory):
    # a model whose layers differ in KV heads (MiMo-V2's sliding layers have twice as many):
    # each layer's cache is its own shape
    model = tiny_model("llama")
    layer = model.model.layers[1].self_attn
    with torch.no_grad():
        layer.k_proj.weight = torch.nn.Parameter(layer.k_proj.weight.repeat(2, 1))
        layer.v_proj.weight = torch.nn.Parameter(layer.v_proj.weight.repeat(2, 1))
    layer.num_key_value_groups //= 2
    ids, mask = batch_factory([5, 20])
    ref = _generate(model, ids, mask)
    # (fused projections are sized from the config, which this edit leaves behind)
    hf_paged.patch(model, num_blocks=16, block_size=8, fuse_projections=False)
    try:
        spec = hf_paged.get_engine(model).runner.kv_spec
        assert [s.num_kv_heads for s in spec.layers] == [2, 4]
        assert torch.equal(
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12),
            ref,
        )
    finally:
        hf_paged.unpatch(model)


def test_config_geometry_without_a_probe():
    # a model whose forward cannot be probed keeps the config's one geometry, as before
    class Config:
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 3, 4, 2, 64

        def get_text_config(self):
            return self

    class Model(torch.nn.Module):
        config = Config()

    spec = KVCacheSpec(Model(), 16, torch.float32)
    assert spec.layers == [LayerKVShape(2, 16, 16)] * 3
