"""Multi-LoRA on fused projections (hf_paged/lora/slots.py groups, hf_paged/lora/layers.py's
product hook), CPU, float32: a decoder layer runs 4 LoRA ops (q/k/v as one shrink + one expand
over the fused product, o, gate/up as one, down), none writing a strided slice; the small-batch
forward makes 4 shrink launches a layer and no expand (the deltas in the GEMV epilogues, q/k/v's
in the one-launch norm + q/k/v + RoPE); the
slices' LoRA layers hold views of their group's buffers, so a slot is written once; a slice
disabled on its own falls back to per-slice deltas. Tokens equal peft's throughout."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams
from tests.conftest import count_small_batch_rows, fold_lora_shrinks, peft_generate_alone

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# rank 5 on everything, rank 3 on q/v only (k's part of the group stays zero for it)
ADAPTERS = {"all": (5, ALL, False), "qv": (3, ["q_proj", "v_proj"], True)}
ENGINE = dict(attention_backend="triton", async_scheduling=False)


def _model(peft_model):
    return peft_model(ADAPTERS, seed=11)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _params(name, n=4):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, adapter=name)


def _layer(model, i=0):
    return model.get_base_model().model.layers[i]


def test_a_layers_qkv_group_is_one_shrink_op(peft_model, monkeypatch):
    from hf_paged.lora import layers

    model = _model(peft_model)
    prompts = _prompts([7, 5, 9], seed=1)
    names = ["all", None, "qv"]
    want = [peft_generate_alone(model, p, n, 4) for p, n in zip(prompts, names)]
    eng = Engine(model, small_batch_rows=0, **ENGINE)  # the transformers forward only
    attn, mlp = _layer(model).self_attn, _layer(model).mlp
    qkv = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
    inter = mlp.gate_proj.out_features
    calls = []
    real = layers._add

    def counting(y, x, a, b, scale, slices):
        calls.append((None if slices is None else list(slices), y.is_contiguous(), a.shape[1]))
        return real(y, x, a, b, scale, slices)

    monkeypatch.setattr(layers, "_add", counting)
    got = [o.output_token_ids for o in eng.generate(prompts, [_params(n) for n in names])]
    eng.shutdown()
    assert got == want
    # every layer of every step: q/k/v in one op over the group's stacked A (3 slices of
    # max_lora_rank 5), then o, gate/up in one, down; each writing a contiguous product
    per_layer = [(qkv, True, 15), (None, True, 5), ([inter, inter], True, 10), (None, True, 5)]
    layers_n = model.config.num_hidden_layers
    assert calls and len(calls) % (4 * layers_n) == 0
    assert calls == per_layer * (len(calls) // 4)


def test_folded_projections_shrink_in_their_base_gemm(peft_model, monkeypatch):
    # each projection's GEMM computes x @ [W; A_0; ...; A_S-1]^T: per layer and step, four
    # expands read their tokens' slots' columns of it, and no separate shrink runs
    from hf_paged.lora import fold, layers
    from hf_paged.lora.slots import GROUP_A, A

    fold_lora_shrinks(monkeypatch, True)
    model = _model(peft_model)
    prompts = _prompts([7, 5, 9], seed=1)
    names = ["all", None, "qv"]
    want = [peft_generate_alone(model, p, n, 4) for p, n in zip(prompts, names)]
    eng = Engine(model, small_batch_rows=0, **ENGINE)
    attn, mlp = _layer(model).self_attn, _layer(model).mlp
    fused = attn.q_proj.base_layer.fused
    ext, o_ext = fused._buffers[fold.EXT_WEIGHT], attn.o_proj.base_layer._buffers[fold.EXT_WEIGHT]
    qkv = fused.sizes
    # the weights and the slots' A are views of the extended GEMM's rows: an adapter copied into
    # a slot is in the GEMM
    assert fused.weight.data_ptr() == ext.data_ptr()
    assert fused._buffers[GROUP_A].data_ptr() == ext[sum(qkv)].data_ptr()
    assert getattr(attn.o_proj, A).data_ptr() == o_ext[attn.o_proj.out_features].data_ptr()
    calls, shrinks = [], []
    real = fold.fold_add_

    def counting(full, b, scale, sizes):
        calls.append((list(sizes), full.shape[-1]))
        return real(full, b, scale, sizes)

    monkeypatch.setattr(fold, "fold_add_", counting)
    monkeypatch.setattr(layers, "_add", lambda *a: shrinks.append(a))
    got = [o.output_token_ids for o in eng.generate(prompts, [_params(n) for n in names])]
    s = eng.config.max_loras
    eng.shutdown()
    assert got == want and not shrinks
    inter, hidden = mlp.gate_proj.out_features, attn.o_proj.out_features
    per_layer = [
        (list(qkv), sum(qkv) + s * 15),
        ([hidden], hidden + s * 5),
        ([inter, inter], 2 * inter + s * 10),
        ([hidden], hidden + s * 5),
    ]
    assert calls and calls == per_layer * (len(calls) // 4)
    assert fold.EXT_WEIGHT not in fused._buffers  # shutdown gives the weights their storage back


def test_small_batch_forward_shrinks_once_a_group_and_expands_in_the_gemvs(peft_model, monkeypatch):
    from hf_paged.kernels import lora as lora_kernels

    model = _model(peft_model)
    prompts = _prompts([6, 11, 4], seed=2)
    names = ["qv", "all", None]
    want = [peft_generate_alone(model, p, n, 5) for p, n in zip(prompts, names)]
    eng = Engine(model, small_batch_rows=8, **ENGINE)
    fast = eng.runner.forward.small_batch
    assert fast is not None
    from hf_paged import kernels

    shrinks, expands = [], []
    real_shrink = kernels.lora_rows_shrink

    def shrink(x, a, *args, **kw):
        shrinks.append((a.shape[1], "norm_weight" in kw))
        return real_shrink(x, a, *args, **kw)

    monkeypatch.setattr(kernels, "lora_rows_shrink", shrink)  # the small-batch forward's
    monkeypatch.setattr(lora_kernels, "lora_shrink", lambda *a, **k: expands.append(1))
    monkeypatch.setattr(lora_kernels, "lora_expand", lambda *a, **k: expands.append(1))

    one_launch = []  # norm + q/k/v + RoPE + KV write: with the q/k/v deltas in it
    real_rope = kernels.norm_qkv_rope

    def norm_qkv_rope(*args, **kw):
        one_launch.append(kw.get("lora") is not None)
        return real_rope(*args, **kw)

    monkeypatch.setattr(kernels, "norm_qkv_rope", norm_qkv_rope)

    steps = count_small_batch_rows(eng)
    got = [o.output_token_ids for o in eng.generate(prompts, [_params(n, 5) for n in names])]
    eng.shutdown()
    assert got == want
    assert steps and not expands
    assert fast.cos_table is not None and one_launch and all(one_launch)
    # q/k/v (normalised in the shrink), o, gate/up (normalised), down: per layer per step
    per_layer = [(15, True), (5, False), (10, True), (5, False)]
    assert shrinks == per_layer * model.config.num_hidden_layers * len(steps)


def test_slices_hold_views_of_their_groups_buffers(peft_model):
    from hf_paged.lora.slots import GROUP_A, GROUP_B, GROUP_SCALE, SCALE, A, B

    model = _model(peft_model)
    eng = Engine(model, small_batch_rows=0, max_loras=2, **ENGINE)
    eng.generate(_prompts([5], seed=3), _params("all", 2))
    slot = eng.core.lora.slots.slot_of["all"]
    attn = _layer(model).self_attn
    fused = attn.q_proj.base_layer.fused
    group_a, group_b = fused._buffers[GROUP_A], fused._buffers[GROUP_B]
    r = eng.core.lora.max_rank
    start = 0
    for i, name in enumerate(["q_proj", "k_proj", "v_proj"]):
        layer = getattr(attn, name)
        a, b = getattr(layer, A), getattr(layer, B)
        rows = slice(start, start + layer.out_features)
        assert a.data_ptr() == group_a[:, i * r].data_ptr()  # a view: written once
        assert b.data_ptr() == group_b[:, rows].data_ptr()
        assert getattr(layer, SCALE).data_ptr() == fused._buffers[GROUP_SCALE][i].data_ptr()
        rank = layer.r["all"]
        assert torch.equal(group_a[slot, i * r : i * r + rank], layer.lora_A["all"].weight)
        assert not group_a[slot, i * r + rank : (i + 1) * r].any()  # padded with zeros
        assert torch.equal(group_b[slot, rows, :rank], layer.lora_B["all"].weight)
        start += layer.out_features
    eng.shutdown()
    assert GROUP_A not in fused._buffers and not hasattr(attn.q_proj, A)  # they leave with it


@pytest.mark.parametrize("small_batch_rows, folded", [(0, False), (8, False), (0, True), (8, True)])
def test_a_slice_disabled_alone_takes_per_slice_deltas(
    peft_model, monkeypatch, small_batch_rows, folded
):
    # folded: the group's product leaves the appended rows out (its weight's rows alone) and
    # each live slice shrinks on its own from its view of them
    fold_lora_shrinks(monkeypatch, folded)
    model = _model(peft_model)
    prompts = _prompts([6, 8], seed=4)
    names = ["all", "qv"]
    # layers disabled on their own (peft's own calls disable every layer at once): their groups'
    # other slices still add their deltas, these none, as peft computes it
    alone = [_layer(model, 1).self_attn.k_proj, _layer(model, 0).mlp.up_proj]

    def disabled(on: bool):
        for layer in alone:
            layer.enable_adapters(not on)

    eng = Engine(model, small_batch_rows=small_batch_rows, **ENGINE)  # (its start-up check
    want = []  # enables every layer: they are disabled after it)
    for p, n in zip(prompts, names):
        model.set_adapter(n)  # (peft's set_adapter enables every layer again)
        disabled(True)
        out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=4, do_sample=False)
        want.append(out[0, len(p) :].tolist())
    assert all(layer.disable_adapters for layer in alone)
    got = [o.output_token_ids for o in eng.generate(prompts, [_params(n) for n in names])]
    eng.shutdown()
    assert got == want
    disabled(False)
    assert want[0] != peft_generate_alone(
        model, prompts[0], "all", 4
    )  # the disabled slices mattered
