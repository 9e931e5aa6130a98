"""User logits_processor / stopping_criteria lists, applied per request with transformers'
semantics (and transformers' merge rule for built-in types)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

import hf_paged
from hf_paged import Engine, SamplingParams


class BanOddAfterLength(LogitsProcessor):
    """Depends on the sequence length and on the ids: odd tokens banned once the sequence is
    longer than `length`, and the last token gets a bonus."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        if input_ids.shape[1] > self.length:
            scores[:, 1::2] = float("-inf")
        scores.scatter_add_(1, input_ids[:, -1:], torch.full_like(scores[:, :1], 0.5))
        return scores


class StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _both(model, ids, **gen):
    ref = model.generate(ids, do_sample=False, **gen)
    hf_paged.patch(model)
    try:
        out = model.generate(ids, do_sample=False, **gen)
    finally:
        hf_paged.unpatch(model)
    return ref, out


def test_custom_processor_and_criteria_match_transformers(tiny_model):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(3, 256, (3, 9), generator=g)  # equal lengths: no padding anywhere
    plain = model.generate(
        ids, do_sample=False, max_new_tokens=12, logits_processor=[BanOddAfterLength(13)]
    )
    stop = int(plain[1, 9 + 5])
    gen = dict(
        max_new_tokens=12,
        logits_processor=[BanOddAfterLength(13)],
        stopping_criteria=StoppingCriteriaList([StopOnToken(stop)]),
        pad_token_id=0,
    )
    ref, out = _both(model, ids, **gen)
    assert torch.equal(out, ref)
    assert (ref[:, 9 + 4 + 1 :] % 2 == 0).all()  # the processor bit
    assert ref.shape[1] < 9 + 12 or (ref[:, -1] == 0).any()  # the criterion bit


def test_custom_builtin_types_replace_the_builtin(tiny_model):
    model = tiny_model("qwen2")
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(9))
    gen = dict(
        max_new_tokens=10,
        repetition_penalty=1.1,
        logits_processor=[RepetitionPenaltyLogitsProcessor(2.5)],
        stopping_criteria=[
            MaxLengthCriteria(max_length=12),
            EosTokenCriteria(eos_token_id=[200, 201]),
        ],
    )
    ref, out = _both(model, ids, **gen)
    assert ref.shape[1] <= 12
    assert torch.equal(out, ref)


def test_engine_rows_with_their_own_processors(tiny_model):
    model = tiny_model("llama")
    engine = Engine(model)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12] * 7]
    params = [
        SamplingParams(max_tokens=8, temperature=0, logits_processors=[BanOddAfterLength(6)]),
        SamplingParams(max_tokens=8, temperature=0),
        SamplingParams(
            max_tokens=8,
            temperature=0,
            stopping_criteria=[StopOnToken(-5)],
            logits_processors=[BanOddAfterLength(0)],
        ),
    ]
    outs = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        lp = p.logits_processors or []
        ref = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, logits_processor=lp
        )[0, len(prompt) :]
        assert out.output_token_ids == ref.tolist()
    assert all(t % 2 == 0 for t in outs[2].output_token_ids)


def test_criteria_receive_scores_when_kept(tiny_model):
    seen = []

    class Spy(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append((input_ids.shape, None if scores is None else len(scores)))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    engine = Engine(tiny_model("llama"))
    engine.generate(
        [[4, 5, 6]], SamplingParams(max_tokens=3, temperature=0, stopping_criteria=[Spy()])
    )
    engine.generate(
        [[4, 5, 6]],
        SamplingParams(max_tokens=2, temperature=0, output_scores=True, stopping_criteria=[Spy()]),
    )
    assert seen == [((1, 4), None), ((1, 5), None), ((1, 4), 1)]
