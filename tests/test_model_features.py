"""Architectures that need an attention feature beyond plain causal softmax attention, end to
end: greedy float32 output token-identical to transformers' generate, with the torch backend and
the Triton kernels (interpreted on CPU). Attention sinks: gpt-oss (s_aux)."""

from __future__ import annotations

import pytest
import torch

import hf_paged

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
