"""GenerationConfig options through the engine: greedy-exact parity with transformers' generate,
per-row options in mixed Engine batches, stop conditions, bad option values."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import Engine, SamplingParams

LENGTHS = [5, 11, 3, 8]


def _generate(model, ids, mask, **gen):
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen)


def _paged(model, ids, mask, **gen):
    hf_paged.patch(model, block_size=8)
    try:
        return _generate(model, ids, mask, **gen)
    finally:
        hf_paged.unpatch(model)


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def batch(batch_factory):
    return batch_factory(LENGTHS, seed=11)


@pytest.fixture
def word_tokenizer():
    from hf_paged.testing import tiny_tokenizer

    return tiny_tokenizer()


GREEDY_OPTIONS = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "repetition_penalty_below_1": dict(repetition_penalty=0.7),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "no_repeat_ngram_size_1": dict(no_repeat_ngram_size=1),
    "bad_words_ids": dict(bad_words_ids=None),  # filled from the baseline in the test
    "suppress_tokens": dict(suppress_tokens=None),
    "begin_suppress_tokens": dict(begin_suppress_tokens=None),
    "min_new_tokens": dict(min_new_tokens=12, eos_token_id=None),
    "min_length": dict(min_length=20, eos_token_id=None),
    "eos_token_id_list": dict(eos_token_id=None, pad_token_id=0),
    "max_length": dict(max_length=17),
    "renormalize_logits": dict(renormalize_logits=True, repetition_penalty=1.2),
    # the last new token forced, over a min-length ban of the same id (transformers' order)
    "forced_eos_token_id": dict(forced_eos_token_id=7, min_new_tokens=16, eos_token_id=[7]),
    "forced_eos_suppressed": dict(forced_eos_token_id=[7, 9], suppress_tokens=[7]),
    "combined": dict(
        repetition_penalty=1.3,
        no_repeat_ngram_size=3,
        suppress_tokens=[4, 5, 6],
        min_new_tokens=3,
        eos_token_id=None,
    ),
}


@pytest.mark.parametrize("name", list(GREEDY_OPTIONS))
def test_greedy_option_matches_transformers(name, llama, batch):
    ids, mask = batch
    steps = 16
    base = _generate(llama, ids, mask, max_new_tokens=steps)
    new = base[:, ids.shape[1] :]
    gen = dict(GREEDY_OPTIONS[name])
    if "max_length" not in gen:
        gen["max_new_tokens"] = steps
    # option values that bite: tokens the plain greedy continuation actually produces
    if name == "bad_words_ids":
        gen["bad_words_ids"] = [[int(new[0, 2])], [int(new[1, 3]), int(new[1, 4])]]
    if name == "suppress_tokens":
        gen["suppress_tokens"] = [int(new[2, 1]), int(new[3, 5])]
    if name == "begin_suppress_tokens":
        gen["begin_suppress_tokens"] = [int(new[0, 0]), int(new[1, 0])]
    if gen.get("eos_token_id", 0) is None:  # eos ids that occur early in the continuations
        gen["eos_token_id"] = [int(new[0, 1]), int(new[2, 4])]
    ref = _generate(llama, ids, mask, **gen)
    out = _paged(llama, ids, mask, **gen)
    assert out.shape == ref.shape
    assert torch.equal(out, ref)
    if name not in ("max_length", "renormalize_logits"):
        same = ref.shape == base.shape and torch.equal(ref, base)
        assert not same, "the option changed nothing"


def test_stop_strings_match_transformers(llama, batch, word_tokenizer):
    ids, mask = batch
    base = _generate(llama, ids, mask, max_new_tokens=12)
    new = base[:, ids.shape[1] :]
    # text that two rows produce (decoded pairs of tokens), so the stop strings fire mid-way
    stops = [word_tokenizer.decode(new[0, 3:5]).strip(), word_tokenizer.decode(new[2, 1:3]).strip()]
    assert all(stops)
    gen = dict(max_new_tokens=12, stop_strings=stops, tokenizer=word_tokenizer, pad_token_id=0)
    ref = _generate(llama, ids, mask, **gen)
    out = _paged(llama, ids, mask, **gen)
    assert ref.shape[1] < base.shape[1] or (ref[:, -1] == 0).any()  # a stop string fired
    assert torch.equal(out, ref)


def test_stop_strings_need_a_tokenizer(llama, batch):
    ids, mask = batch
    hf_paged.patch(llama)
    try:
        with pytest.raises(ValueError, match="stop_strings"):
            llama.generate(input_ids=ids, attention_mask=mask, stop_strings=["x"], max_new_tokens=3)
        engine = hf_paged.get_engine(llama)
        with pytest.raises(ValueError, match="stop_strings"):
            engine.add_request([5, 6], SamplingParams(stop_strings=["x"]))
        assert not engine.has_unfinished_requests()
    finally:
        hf_paged.unpatch(llama)


def test_mixed_batch_each_row_its_own_options(llama):
    """Engine API: every row of one batch uses different options; each equals transformers' own
    generate of that row alone with the same options."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 13, 4, 9, 20, 7)]
    rows = [
        (dict(), SamplingParams(max_tokens=14, temperature=0)),
        (
            dict(repetition_penalty=1.6),
            SamplingParams(max_tokens=14, temperature=0, repetition_penalty=1.6),
        ),
        (
            dict(no_repeat_ngram_size=2),
            SamplingParams(max_tokens=14, temperature=0, no_repeat_ngram_size=2),
        ),
        (
            dict(suppress_tokens=list(range(100, 180))),
            SamplingParams(max_tokens=14, temperature=0, suppress_tokens=list(range(100, 180))),
        ),
        (
            dict(max_new_tokens=6, min_new_tokens=4, eos_token_id=[7, 9, 11]),
            SamplingParams(max_tokens=6, min_tokens=4, temperature=0, eos_token_id=[7, 9, 11]),
        ),
        (
            dict(bad_words_ids=[[50], [60, 61]], repetition_penalty=0.8),
            SamplingParams(
                max_tokens=14, temperature=0, bad_words_ids=[[50], [60, 61]], repetition_penalty=0.8
            ),
        ),
    ]
    engine = Engine(llama, block_size=8, max_num_batched_tokens=24)  # chunked prefill too
    outs = engine.generate(prompts, [p for _, p in rows])
    for prompt, (gen, _), out in zip(prompts, rows, outs):
        gen = {"max_new_tokens": 14, **gen}
        ref = llama.generate(torch.tensor([prompt]), do_sample=False, **gen)[0, len(prompt) :]
        got, ref = out.output_token_ids, ref.tolist()
        eos = gen.get("eos_token_id") or []
        stop = next((k + 1 for k, t in enumerate(ref) if t in eos), len(ref))
        assert got == ref[:stop]  # transformers pads after eos; the engine just stops
    engine.check_invariants()


def test_presence_and_frequency_penalties_follow_vllm(llama):
    """vLLM's rule: logits - frequency * count - presence * (count > 0), output tokens only."""
    engine = Engine(llama)
    prompt = [5, 6, 7, 8]
    base = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0]
    params = SamplingParams(
        max_tokens=10,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        output_scores=True,
        output_logits=True,
    )
    out = engine.generate([prompt], params)[0]
    counts = torch.zeros(256)
    for raw, score, tok in zip(out.logits, out.scores, out.output_token_ids):
        expect = raw - 0.7 * counts - 0.5 * (counts > 0).float()
        torch.testing.assert_close(score, expect)
        assert tok == int(expect.argmax())
        counts[tok] += 1
    assert out.output_token_ids != base.output_token_ids


def test_top_n_logprobs_are_the_raw_distribution(llama):
    engine = Engine(llama)
    prompt = [9, 8, 7]
    out = engine.generate(
        [prompt],
        SamplingParams(
            max_tokens=4, temperature=0, logprobs=3, output_logits=True, repetition_penalty=2.0
        ),
    )[0]
    assert len(out.logprobs) == 4
    for entry, raw, tok in zip(out.logprobs, out.logits, out.output_token_ids):
        logp = raw.log_softmax(-1)
        top = logp.topk(3)
        assert tok in entry and abs(entry[tok] - logp[tok].item()) < 1e-5
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < 1e-5
        assert len(entry) in (3, 4)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"typical_p": 0.0}, "typical_p"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"bad_words_ids": [[1], "x"]}, "bad_words_ids"),
        ({"bad_words_ids": [[-3]]}, "bad_words_ids"),
        ({"suppress_tokens": [1.5]}, "suppress_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": -2}, "logprobs"),
        ({"stop_strings": [""]}, "stop_strings"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"logits_processors": [3]}, "logits_processors"),
    ],
)
def test_bad_option_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_do_not_leak_and_others_finish(llama):
    engine = Engine(llama, block_size=8)
    ok = engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=6, repetition_penalty=1.2, temperature=0)
    )
    engine.step()
    with pytest.raises(ValueError, match="bad_words_ids"):
        engine.add_request([5], SamplingParams(bad_words_ids=[[300]]))
    with pytest.raises(ValueError, match="n:"):
        engine.add_request([5], SamplingParams(n=10_000))
    with pytest.raises(ValueError, match="forced_eos_token_id"):
        engine.add_request([5], SamplingParams(forced_eos_token_id=[7, 300]))
    with pytest.raises(ValueError, match="forced_eos_token_id"):
        SamplingParams(forced_eos_token_id=-1)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == ok and len(outs[-1].output_token_ids) == 6
    engine.check_invariants()


def test_unsupported_generation_options_are_refused(llama, batch):
    ids, mask = batch
    hf_paged.patch(llama)
    try:
        for kw, name in [
            (dict(epsilon_cutoff=0.1, do_sample=True), "epsilon_cutoff"),
            (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
            (dict(sequence_bias=[[[5], -1.0]]), "sequence_bias"),
            (dict(prefix_allowed_tokens_fn=lambda b, s: [1]), "prefix_allowed_tokens_fn"),
            (dict(forced_eos_token_id=3, num_beams=2), "forced_eos_token_id"),
        ]:
            with pytest.raises(ValueError, match=name):
                llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, **kw)
        assert llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2).shape[1] == 13
    finally:
        hf_paged.unpatch(llama)
