"""Fused q/k/v and gate/up projections (Engine(fuse_projections=True)): same logits and greedy
tokens as the original layers, only plain nn.Linear groups fused, and the model put back exactly
by unpatch."""

from __future__ import annotations

import pytest
import torch
from hf_paged.integrations.fused_projections import (
    ProjectionSlice,
    fuse_projections,
    unfuse_projections,
)
from torch import nn

import hf_paged
from hf_paged import Engine, SamplingParams

# groups fused per decoder layer: q/k/v and gate/up; phi3 and gpt_neox already fuse theirs
GROUPS_PER_LAYER = {"llama": 2, "qwen2": 2, "qwen3": 2, "gemma2": 2, "olmo2": 2, "mistral": 2}


@pytest.mark.parametrize("arch", [*GROUPS_PER_LAYER, "phi3", "gpt_neox"])
def test_fused_logits_equal_original(arch, tiny_model, batch_factory):
    model = tiny_model(arch)
    ids, mask = batch_factory([5, 30, 17])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        n = fuse_projections(model)
        got = model(input_ids=ids, attention_mask=mask).logits
    assert n == GROUPS_PER_LAYER.get(arch, 0) * model.config.num_hidden_layers
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    unfuse_projections(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2"])
def test_patched_generate_with_fused_projections_matches_transformers(
    arch, tiny_model, batch_factory
):
    model = tiny_model(arch)
    ids, mask = batch_factory([1, 40, 90, 7], seed=2)
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    hf_paged.patch(model, fuse_projections=True)
    try:
        assert hf_paged.get_engine(model).num_fused_projections > 0
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)


def test_unpatch_restores_the_model_exactly(tiny_model):
    model = tiny_model("qwen2")  # q/k/v biases too
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {k: p.requires_grad for k, p in model.named_parameters()}
    hf_paged.patch(model, fuse_projections=True)
    assert any(isinstance(m, ProjectionSlice) for m in model.modules())
    hf_paged.unpatch(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert {k: p.requires_grad for k, p in model.named_parameters()} == grads
    assert all(
        type(m.self_attn.q_proj) is nn.Linear and type(m.mlp.up_proj) is nn.Linear
        for m in model.model.layers
    )


def test_only_plain_linear_groups_are_fused(tiny_model):
    class Wrapped(nn.Linear):  # stands for a LoRA- or bitsandbytes-wrapped layer
        pass

    model = tiny_model("llama")
    first = model.model.layers[0].self_attn
    old = first.k_proj
    first.k_proj = Wrapped(old.in_features, old.out_features, bias=False)
    first.k_proj.weight = old.weight
    n = fuse_projections(model)
    layers = model.config.num_hidden_layers
    assert n == 2 * layers - 1  # that layer's q/k/v stays unfused, its gate/up is fused
    assert type(first.q_proj) is nn.Linear
    unfuse_projections(model)


def test_out_of_order_calls_compute_their_own_slice(tiny_model):
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        want = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        fuse_projections(model)
        y = torch.randn_like(x)
        attn.q_proj(y)  # the group now holds y's product
        got_v, got_k = attn.v_proj(x), attn.k_proj(x)  # other input, other order
        got_q = attn.q_proj(x)
    torch.testing.assert_close(got_k, want[1])
    torch.testing.assert_close(got_v, want[2])
    torch.testing.assert_close(got_q, want[0])


def test_compiled_fused_engine_matches_eager(tiny_model):
    model = tiny_model("llama", num_hidden_layers=1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 40, 2)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = Engine(model, attention_backend="torch")
    want = [o.output_token_ids for o in eager.generate(prompts, params)]
    eager.shutdown()
    torch._dynamo.reset()
    eng = Engine(model, attention_backend="torch", compile=True, fuse_projections=True)
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    eng.shutdown()
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


def test_state_dict_keeps_original_names_while_fused(tiny_model):
    model = tiny_model("qwen2")  # q/k/v biases too
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    during = model.state_dict()
    assert list(during) == list(before)  # same names, same order: save_pretrained sees no change
    for k, v in before.items():
        assert torch.equal(during[k], v), k
    storages = [during[k].untyped_storage().data_ptr() for k in during if "_proj." in k]
    assert len(set(storages)) == len(storages)  # no shared storage: safetensors can save it
    unfuse_projections(model)


def test_load_state_dict_into_fused_model_writes_the_fused_matrix(tiny_model, batch_factory):
    source, target = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=2)
    ids, mask = batch_factory([6, 11])
    with torch.no_grad():
        want = source(input_ids=ids, attention_mask=mask).logits
        fuse_projections(target)
        result = target.load_state_dict(source.state_dict(), strict=True)
        got = target(input_ids=ids, attention_mask=mask).logits
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    partial = {k: v for k, v in source.state_dict().items() if "k_proj" not in k}
    missing = target.load_state_dict(partial, strict=False).missing_keys
    assert missing and all("k_proj" in k for k in missing)
    bad = dict(source.state_dict())
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="q_proj.weight"):
        target.load_state_dict(bad)
    unfuse_projections(target)


def test_save_pretrained_while_patched_round_trips(tiny_model, tmp_path, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([5, 9])
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    hf_paged.patch(model, fuse_projections=True)
    try:
        assert hf_paged.get_engine(model).num_fused_projections > 0
        model.save_pretrained(tmp_path)
    finally:
        hf_paged.unpatch(model)
    reloaded = type(model).from_pretrained(tmp_path)
    out = reloaded.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert torch.equal(out, ref)
