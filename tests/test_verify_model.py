"""The start-up check (hf_paged/engine/verify.py): a model whose paged forward differs from
transformers' own is refused at patch / Engine construction, naming the model; one that matches
is accepted and the check leaves nothing behind; verify_model=False turns it off."""

from __future__ import annotations

import types

import pytest
import torch

import hf_paged
from hf_paged import Engine
from hf_paged.engine import verify
from hf_paged.worker.forward_context import in_engine_step
from hf_paged.worker.startup import KVCacheSpec


def _leaky_llama(tiny_model):
    """A llama whose first MLP adds a running mean over the token dimension: state carried
    along the sequence that is not a KV cache (as SSM or convolution layers carry). In the
    engine's flat batch the second prompt reads the first one's tokens."""
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    original = mlp.forward

    def forward(self, x):
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return original(x) + 4.0 * x.cumsum(1) / steps

    mlp.forward = types.MethodType(forward, mlp)
    return model


def _reference_tokens(model, batch_factory):
    ids, mask = batch_factory([9, 23])
    gen = dict(do_sample=False, max_new_tokens=8)
    return ids, mask, model.generate(input_ids=ids, attention_mask=mask, **gen)


def test_llama_is_accepted_and_the_check_leaves_nothing(tiny_model):
    model = tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"
    engine = Engine(model, num_blocks=32, block_size=4)
    try:
        assert engine.verify_error is not None
        assert engine.verify_error <= 1e-5  # float32: rounding only (measured ~3e-7)
        stats = engine.stats()
        assert stats["free_blocks"] == stats["num_blocks"] == 32
        assert stats["num_steps"] == 0 and stats["peak_blocks_used"] == 0
        assert not engine.scheduler.requests and not engine.has_unfinished_requests()
        for k_cache, v_cache in engine.runner.kv_caches:  # written by the check, zeroed again
            assert not k_cache.any() and not v_cache.any()
        assert model.config._attn_implementation == "hf_paged"  # as the engine leaves it
    finally:
        engine.shutdown()
    assert model.config._attn_implementation == "sdpa"


def test_leaking_state_is_refused_in_the_prompt_forward(tiny_model, batch_factory):
    model = _leaky_llama(tiny_model)
    with pytest.raises(ValueError) as info:
        hf_paged.patch(model)
    message = str(info.value)
    assert "LlamaForCausalLM (model_type 'llama')" in message
    assert "already in the prompt forward" in message
    assert "not a KV cache" in message and "verify_model=False" in message
    # refused means untouched: the model's own attention and generate, no engine, no lease
    assert model.config._attn_implementation == "sdpa"
    assert "generate" not in model.__dict__ and "_hf_paged_lease" not in model.__dict__
    with pytest.raises(ValueError, match="not patched"):
        hf_paged.get_engine(model)


def test_two_attention_calls_are_refused_at_the_decode_step(tiny_model):
    """Differential attention (DiffLlama) calls attention twice per layer: in the paged cache the
    second call's K/V overwrite the first's, so the prompt forward agrees and the decode step
    does not."""
    model = tiny_model("diffllama")
    with pytest.raises(ValueError, match="at the decode step") as info:
        Engine(model)
    assert "DiffLlamaForCausalLM (model_type 'diffllama')" in str(info.value)
    difference = float(str(info.value).split("largest difference ")[1].split(" ")[0])
    assert difference > 100 * verify.TOLERANCE[torch.float32]  # far from rounding
    assert model.config._attn_implementation == "sdpa"


def test_the_option_turns_the_check_off(tiny_model, batch_factory):
    """verify_model=False: the same model patches, and then answers differently from
    transformers, which is what the check refused."""
    model = tiny_model("diffllama")
    ids, mask, ref = _reference_tokens(model, batch_factory)
    hf_paged.patch(model, verify_model=False)
    try:
        assert hf_paged.get_engine(model).verify_error is None
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    finally:
        hf_paged.unpatch(model)
    assert not torch.equal(out, ref)


def test_a_forward_that_fails_in_engine_steps_is_refused_as_a_value_error(tiny_model):
    """As the sparse-attention indexers that index the attention mask, None inside a step."""
    model = tiny_model("llama")
    attn = model.model.layers[1].self_attn
    original = attn.forward

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        if in_engine_step():
            attention_mask[:, 0]  # TypeError: 'NoneType' object is not subscriptable
        return original(hidden_states, position_embeddings, attention_mask, **kwargs)

    attn.forward = types.MethodType(forward, attn)
    with pytest.raises(ValueError, match="fails in a paged forward .TypeError") as info:
        hf_paged.patch(model)
    assert "model_type 'llama'" in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_passes_within_its_tolerance(tiny_model, dtype):
    model = tiny_model("gemma2", dtype=dtype)  # eager attention, softcaps, sliding window
    engine = Engine(model)
    try:
        assert 0 < engine.verify_error <= verify.TOLERANCE[dtype]
    finally:
        engine.shutdown()


def test_sliding_window_prompt_reaches_past_the_window(tiny_model):
    """Windows applied only through the mask are caught only by a prompt longer than them."""
    model = tiny_model("mistral")  # sliding_window=24
    assert verify._prompt_lengths(model, 64, 16) == (28, 6)
    assert verify._prompt_lengths(model, 2, 16) == (11, 5)  # a small cache: shorter prompts
    assert verify._prompt_lengths(tiny_model("llama"), 3, 4) == (7, 3)
    assert verify._prompt_lengths(tiny_model("llama"), 1, 4) == (3,)
    assert verify._prompt_lengths(tiny_model("llama"), 1, 1) == ()
    assert verify._prompt_lengths(model, 64, 16, max_model_len=12) == (11, 5)


def test_a_second_engine_reuses_the_reference_without_switching_attention(tiny_model, monkeypatch):
    """Later Engines on a model must not switch its attention under a live one: they compare
    against the reference the first one took."""
    model = tiny_model("qwen2")
    first = Engine(model)
    switches = []
    real = type(model).set_attn_implementation

    def counting(self, name, *args, **kwargs):
        switches.append(name)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(type(model), "set_attn_implementation", counting)
    second = Engine(model)
    try:
        assert second.verify_error == first.verify_error
        assert switches == []
    finally:
        second.shutdown()
        first.shutdown()


def test_per_layer_kv_geometry_is_refused_naming_the_field():
    """Gemma 4's config raises on head_dim (one per layer type): a ValueError naming it."""

    class PerLayerConfig:
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 2, 4, 2, 64

        @property
        def head_dim(self):
            raise RuntimeError("'head_dim' is a per-layer attribute")

        def get_text_config(self):
            return self

    class Model(torch.nn.Module):
        config = PerLayerConfig()

    with pytest.raises(ValueError, match="Model: its config's head_dim cannot be read as one"):
        KVCacheSpec(Model(), 16, torch.float32)


def test_bad_option_value_names_the_field(tiny_model):
    with pytest.raises(ValueError, match="verify_model must be True or False, got 'yes'"):
        Engine(tiny_model("llama"), verify_model="yes")


def _deep_gemma4():
    """The coverage report's float32 Gemma 4 text model (sharpened output head) at its default
    30 layers: its attention is unscaled (logits up to ~60), and the depth amplifies float32
    rounding past the check's 1e-4 on its own."""
    import importlib

    from hf_paged.testing import load_evals

    load_evals()
    coverage = importlib.import_module("hf_paged_evals.coverage")
    return coverage.tiny_model("gemma4_text", skip=coverage.RETRY_WITHOUT)


def test_rounding_within_transformers_own_spread_passes(one_torch_thread):
    """Past the float32 tolerance, but no further from transformers' sdpa forward than its
    own eager forward is: accepted, the error kept on the engine. (In float64 the paged path
    is exact on this model: tests/test_attention_reference.py.)"""
    model = _deep_gemma4()
    engine = Engine(model, num_blocks=64, compile=False)
    try:
        assert verify.TOLERANCE[torch.float32] < engine.verify_error < 1e-2
    finally:
        engine.shutdown()


def test_a_difference_beyond_transformers_own_spread_is_refused_naming_it(tiny_model, monkeypatch):
    """The leaky model's difference is far past SPREAD_FACTOR times transformers' own spread
    (rounding level on a Llama): refused, and the message gives the spread."""
    model = _leaky_llama(tiny_model)
    with pytest.raises(ValueError, match="differs from itself under another attention"):
        hf_paged.patch(model)
    # without a second implementation to measure against, the plain tolerance decides
    monkeypatch.setattr(verify, "_reference_spread", lambda *a, **k: None)
    with pytest.raises(ValueError, match="the torch.float32 tolerance is 0.0001\\)"):
        hf_paged.patch(model)
