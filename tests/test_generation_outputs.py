"""return_dict_in_generate outputs: scores/logits equal transformers', compute_transition_scores."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

import hf_paged


def _both(model, ids, mask, **gen):
    ref = model.generate(input_ids=ids, attention_mask=mask, **gen)
    hf_paged.patch(model, block_size=8)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, **gen)
    finally:
        hf_paged.unpatch(model)
    return ref, out


def test_scores_logits_and_transition_scores_match(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([6, 10, 3], seed=21)
    plain = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    eos = int(plain[1, ids.shape[1] + 4])  # row 1 stops early
    gen = dict(
        do_sample=False,
        max_new_tokens=10,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        repetition_penalty=1.3,
        eos_token_id=eos,
        pad_token_id=0,
        forced_eos_token_id=5,  # the last step's scores: -inf but 0 at token 5
    )
    ref, out = _both(model, ids, mask, **gen)
    assert torch.isinf(out.scores[-1]).sum() == out.scores[-1].numel() - len(ids)
    assert type(out) is type(ref)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) and len(out.logits) == len(ref.logits)
    new = ref.sequences[:, ids.shape[1] :]
    live = torch.ones_like(new, dtype=torch.bool)  # steps where the row had not finished yet
    for i in range(new.shape[0]):
        hits = (new[i] == eos).nonzero()
        if len(hits):
            live[i, int(hits[0]) + 1 :] = False
    assert not live.all()
    for step, (a, b, la, lb) in enumerate(zip(out.scores, ref.scores, out.logits, ref.logits)):
        rows = live[:, step]
        torch.testing.assert_close(a[rows], b[rows], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(la[rows], lb[rows], rtol=1e-4, atol=1e-4)
    for normalize in (False, True):
        cts = model.compute_transition_scores
        t_ref = cts(ref.sequences, ref.scores, normalize_logits=normalize)
        t_out = cts(out.sequences, out.scores, normalize_logits=normalize)
        torch.testing.assert_close(t_out[live], t_ref[live], rtol=1e-4, atol=1e-4)
        assert torch.all(t_out[~live] == 0)  # filler after a row ended: log-prob 0 for the pad


def test_sampled_scores_are_the_warped_logits(tiny_model, batch_factory):
    model = tiny_model("qwen2")
    ids, mask = batch_factory([4, 7], seed=22)
    hf_paged.patch(model)
    try:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=0.8,
            top_k=10,
            max_new_tokens=5,
            return_dict_in_generate=True,
            output_scores=True,
            output_logits=True,
        )
    finally:
        hf_paged.unpatch(model)
    for scores, logits in zip(out.scores, out.logits):
        ref = TopKLogitsWarper(10)(None, TemperatureLogitsWarper(0.8)(None, logits.clone()))
        torch.testing.assert_close(scores, ref)
    trans = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    assert torch.isfinite(trans).all()  # every sampled token was inside the top-k
