"""Beam search on the paged cache: token-identical to transformers, same outputs, shared blocks."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import SamplingParams


def _both(model, ids, mask, engine_options=None, **gen):
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen)
    hf_paged.patch(model, **(engine_options or {"block_size": 4}))
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen)
        stats = hf_paged.get_engine(model).stats()
    finally:
        hf_paged.unpatch(model)
    return ref, out, stats


CONFIGS = {
    "plain": dict(num_beams=3),
    "return_sequences": dict(num_beams=4, num_return_sequences=3, length_penalty=0.5),
    "early_stopping": dict(num_beams=3, early_stopping=True, length_penalty=2.0),
    "never": dict(
        num_beams=2, early_stopping="never", repetition_penalty=1.3, no_repeat_ngram_size=2
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_beam_search_matches_transformers(name, tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([5, 9, 3], seed=4)
    greedy = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=9)
    new = greedy[:, ids.shape[1] :]
    eos = [int(new[0, 3]), int(new[1, 5]), int(new[2, 2])]  # hypotheses finish at different steps
    gen = dict(
        CONFIGS[name],
        max_new_tokens=9,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ref, out, _ = _both(model, ids, mask, **gen)
    assert type(out) is type(ref)
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.beam_indices, ref.beam_indices)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=1e-4, atol=1e-4)
    assert (out.sequences[:, ids.shape[1] :] != 0).any()


def test_beam_scores_logits_and_transition_scores(tiny_model, batch_factory):
    model = tiny_model("qwen2")
    ids, mask = batch_factory([6, 4], seed=5)
    gen = dict(
        num_beams=3,
        num_return_sequences=2,
        max_new_tokens=6,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        eos_token_id=None,
    )
    ref, out, _ = _both(model, ids, mask, **gen)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits)
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    t_ref = model.compute_transition_scores(ref.sequences, ref.scores, ref.beam_indices)
    t_out = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    torch.testing.assert_close(t_out, t_ref, rtol=1e-4, atol=1e-4)


def test_beams_share_blocks_and_other_requests_keep_going(tiny_model):
    model = tiny_model("llama")
    prompt = torch.arange(3, 40)[None]  # 37 tokens, block_size 8: 4 full blocks + a partial
    ref = model.generate(prompt, do_sample=False, num_beams=4, max_new_tokens=6, eos_token_id=None)
    other = [7, 8, 9, 10]
    other_ref = model.generate(
        torch.tensor([other]), do_sample=False, max_new_tokens=20, eos_token_id=None
    )[0, 4:].tolist()
    hf_paged.patch(model, block_size=8, enable_prefix_caching=False)
    try:
        engine = hf_paged.get_engine(model)
        rid = engine.add_request(
            other, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        )
        out = model.generate(
            prompt, do_sample=False, num_beams=4, max_new_tokens=6, eos_token_id=None
        )
        # 4 beams x 43 tokens would need 4 x 6 = 24 blocks unshared; plus the other request
        assert engine.stats()["peak_blocks_used"] <= 4 + 4 * 2 + 3
        rest = []
        while engine.has_unfinished_requests():
            rest += [o for o in engine.step() if o.request_id == rid and o.finished]
        engine.check_invariants()
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)
    assert rest and rest[-1].output_token_ids == other_ref


def test_beam_search_refusals(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([3, 4])
    hf_paged.patch(model)
    try:
        with pytest.raises(ValueError, match="streamer"):
            model.generate(input_ids=ids, attention_mask=mask, num_beams=2, streamer=object())
        with pytest.raises(ValueError, match="num_beams"):
            model.generate(input_ids=ids, attention_mask=mask, num_beams=2, do_sample=True)
        assert not hf_paged.get_engine(model).has_unfinished_requests()
    finally:
        hf_paged.unpatch(model)
