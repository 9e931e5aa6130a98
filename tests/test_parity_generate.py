"""Ladder step 3: greedy output token-identical to transformers' generate (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

import hf_paged

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2", "gpt_neox"]
LENGTHS = [1, 7, 16, 33, 64, 150, 300, 90]  # mixed prompt lengths, 1..300


def _reference(model, ids, mask, **gen):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen)


def _paged(model, ids, mask, options, **gen):
    hf_paged.patch(model, **options)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen)
        engine = hf_paged.get_engine(model)
        engine.check_invariants()
        return out, engine.stats()
    finally:
        hf_paged.unpatch(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_mixed_lengths(arch, tiny_model, batch_factory):
    model = tiny_model(arch)
    ids, mask = batch_factory(LENGTHS)
    ref = _reference(model, ids, mask, max_new_tokens=64)
    out, _ = _paged(model, ids, mask, {"block_size": 16}, max_new_tokens=64)
    assert out.shape == ref.shape
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_greedy_parity_chunked_prefill(arch, tiny_model, batch_factory):
    model = tiny_model(arch)
    ids, mask = batch_factory(LENGTHS, seed=1)
    ref = _reference(model, ids, mask, max_new_tokens=24)
    hf_paged.patch(model, max_num_batched_tokens=32)
    try:
        engine = hf_paged.get_engine(model)
        real_schedule, partial = engine.scheduler.schedule, []

        def schedule(*a, **k):  # prompt chunks that stop short of the prompt's end
            out = real_schedule(*a, **k)
            for req, n in zip(out.requests, out.num_scheduled_tokens):
                if req.num_computed_tokens + n < req.num_prompt_tokens:
                    partial.append(req.request_id)
            return out

        engine.scheduler.schedule = schedule
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
        engine.check_invariants()
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)
    # the 33-, 64-, 150-, 300- and 90-token prompts exceed the 32-token budget: each was split
    assert len(set(partial)) >= 5, partial


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_parity_under_preemption(arch, tiny_model, batch_factory):
    model = tiny_model(arch)
    ids, mask = batch_factory([40, 60, 30, 80, 50, 20], seed=2)
    ref = _reference(model, ids, mask, max_new_tokens=48)
    # 24 blocks of 8 = 192 token slots for 6 requests needing up to 128 each: forces preemption
    out, stats = _paged(model, ids, mask, {"num_blocks": 24, "block_size": 8}, max_new_tokens=48)
    assert stats["num_preemptions"] > 0
    assert torch.equal(out, ref)


def test_greedy_parity_shared_and_repeated_prefixes(tiny_model):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, 256, (100,), generator=g)
    rows = [torch.cat([system, torch.randint(3, 256, (n,), generator=g)]) for n in (5, 17, 40)]
    rows += [rows[0].clone(), system.clone()]  # an exact repeat, and the bare shared prefix
    longest = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, longest - len(r) :] = r
        mask[i, longest - len(r) :] = 1
    ref = _reference(model, ids, mask, max_new_tokens=32)
    hf_paged.patch(model, block_size=16, max_num_batched_tokens=64)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=32)
        assert torch.equal(out, ref)
        # same batch again: every prompt is now a prefix-cache hit
        again = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=32
        )
        assert torch.equal(again, ref)
        stats = hf_paged.get_engine(model).stats()
        assert stats["prefix_cache_hits"] > 0
        hf_paged.get_engine(model).check_invariants()
    finally:
        hf_paged.unpatch(model)


def test_right_padding_gives_the_unpadded_answer(tiny_model, batch_factory):
    """Right-padded rows: same layout as transformers ([input | new]), and the new tokens are
    those of the unpadded prompt (transformers itself predicts from the pad position there)."""
    model = tiny_model("llama")
    lengths = [12, 5, 9]
    left_ids, left_mask = batch_factory(lengths, seed=4)
    right_ids = torch.zeros_like(left_ids)
    right_mask = torch.zeros_like(left_mask)
    for i, n in enumerate(lengths):
        right_ids[i, :n] = left_ids[i, -n:]
        right_mask[i, :n] = 1
    hf_paged.patch(model)
    try:
        left = model.generate(input_ids=left_ids, attention_mask=left_mask, max_new_tokens=10)
        right = model.generate(input_ids=right_ids, attention_mask=right_mask, max_new_tokens=10)
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(right[:, : right_ids.shape[1]], right_ids)
    assert torch.equal(right[:, right_ids.shape[1] :], left[:, left_ids.shape[1] :])
    for i, n in enumerate(lengths):  # each row alone, unpadded, through transformers
        ref = model.generate(input_ids=left_ids[i : i + 1, -n:], max_new_tokens=10, do_sample=False)
        assert torch.equal(right[i, right_ids.shape[1] :], ref[0, n:])


def test_eos_stops_rows_and_pads_like_transformers(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([10, 20, 30, 40], seed=5)
    base = _reference(model, ids, mask, max_new_tokens=30)
    # choose as EOS ids tokens that appear early in some rows' greedy continuation
    eos = [int(base[0, ids.shape[1] + 3]), int(base[2, ids.shape[1] + 10])]
    ref = _reference(model, ids, mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    out, _ = _paged(model, ids, mask, {}, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert ref.shape[1] < ids.shape[1] + 30 or (ref == 0).any()  # some row really stopped early
    assert torch.equal(out, ref)


def test_max_length_and_return_dict(tiny_model, batch_factory):
    model = tiny_model("qwen2")
    ids, mask = batch_factory([8, 3], seed=6)
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_length=20,
        do_sample=False,
        return_dict_in_generate=True,
    )
    hf_paged.patch(model)
    try:
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_length=20, return_dict_in_generate=True
        )
    finally:
        hf_paged.unpatch(model)
    assert type(out) is type(ref)
    assert torch.equal(out.sequences, ref.sequences)
