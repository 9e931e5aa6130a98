"""The Engine API: prefix-cache counters, seeded sampling, prompt log-probs, abort, bad input."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import hf_paged
from hf_paged import Engine, SamplingParams


@pytest.fixture
def engine(tiny_model):
    eng = Engine(tiny_model("llama"), block_size=16, max_num_batched_tokens=128)
    yield eng
    eng.check_invariants()  # after every engine test: no leaked blocks, consistent refcounts


def _prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def test_repeated_200_token_prompt_computes_at_most_one_block(engine):
    prompt = _prompt(200)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    first = engine.generate([prompt], greedy)[0]
    assert first.num_cached_tokens == 0
    hits_before = engine.stats()["prefix_cache_hits"]
    second = engine.generate([prompt], greedy)[0]
    computed = 200 - second.num_cached_tokens
    assert 1 <= computed <= 16
    assert engine.stats()["prefix_cache_hits"] - hits_before == second.num_cached_tokens == 192
    assert second.output_token_ids == first.output_token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    prompt = _prompt(20, seed=1)
    params = SamplingParams(max_tokens=24, temperature=1.3, top_k=40, top_p=0.95, seed=1234)
    alone = engine.generate([prompt], params)[0].output_token_ids
    again = engine.generate([prompt], params)[0].output_token_ids
    assert alone == again
    # same request inside a batch of other (unseeded and seeded) requests
    others = [_prompt(n, seed=n) for n in (5, 60, 33)]
    batch = engine.generate(
        [others[0], prompt, others[1], others[2]],
        [
            SamplingParams(max_tokens=30),
            params,
            SamplingParams(max_tokens=8, seed=7),
            SamplingParams(max_tokens=12, temperature=0),
        ],
    )
    assert batch[1].output_token_ids == alone
    other_seed = SamplingParams(max_tokens=24, temperature=1.3, top_k=40, top_p=0.95, seed=99)
    assert engine.generate([prompt], other_seed)[0].output_token_ids != alone


def test_patched_generate_sampling_follows_torch_manual_seed(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([6, 11], seed=9)
    hf_paged.patch(model)
    try:
        torch.manual_seed(0)
        a = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=16)
        torch.manual_seed(0)
        b = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=16)
        torch.manual_seed(1)
        c = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=16)
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_prompt_logprobs_match_transformers_forward(tiny_model):
    model = tiny_model("qwen2")
    engine = Engine(model, max_num_batched_tokens=24)  # chunks the prompt: spans cross steps
    prompt = _prompt(50, seed=3)
    out = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()  # outside a step: plain sdpa
    ref = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 50
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), ref, rtol=1e-4, atol=1e-4)
    engine.check_invariants()


def test_step_api_streams_and_abort_keeps_others_going(tiny_model):
    # synchronous stepping: each step() reports that step's token (asynchronous scheduling, the
    # default, reports it on the next call: tests/test_async_scheduling.py)
    engine = Engine(tiny_model("llama"), block_size=16, async_scheduling=False)
    a = engine.add_request(_prompt(10), SamplingParams(max_tokens=20, temperature=0))
    b = engine.add_request(_prompt(12, 2), SamplingParams(max_tokens=20, temperature=0))
    seen = {a: [], b: []}
    for out in engine.step() + engine.step():
        seen[out.request_id].extend(out.new_token_ids)
    engine.abort(a)
    aborted = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == a:  # its final output, once, on the next step
                aborted.append(out)
                continue
            assert out.request_id == b
            seen[b].extend(out.new_token_ids)
            if out.finished:
                assert out.output_token_ids == seen[b] and out.finish_reason == "length"
    assert len(seen[b]) == 20 and len(seen[a]) == 2
    assert [(o.finished, o.finish_reason, o.new_token_ids) for o in aborted] == [
        (True, "abort", [])
    ]
    assert aborted[0].output_token_ids == seen[a]
    engine.check_invariants()


def test_engine_accepts_strings_with_a_tokenizer(tiny_model):
    class CharTokenizer:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [3 + (ord(c) % 200) for c in text]}

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i % 26) for i in ids)

    engine = Engine(tiny_model("llama"), CharTokenizer())
    out = engine.generate(["hello world"], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids == CharTokenizer()("hello world")["input_ids"]
    assert len(out.output_token_ids) == 3
    # the output's text: the generated tokens through the engine's tokenizer, decoded on read
    assert out.text == CharTokenizer().decode(out.output_token_ids) and len(out.text) == 3
    plain = Engine(tiny_model("llama")).generate([[5, 6]], SamplingParams(max_tokens=2))[0]
    assert plain.text is None


# -- bad input: a ValueError naming the field, and the engine keeps serving -----------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_leave_the_engine_serving(engine):
    running = engine.add_request(_prompt(30), SamplingParams(max_tokens=10, temperature=0))
    engine.step()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(_prompt(10), SamplingParams(max_tokens=600))  # beyond 512 positions
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([5, 10_000])
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(_prompt(5), request_id=running)
    with pytest.raises(ValueError, match="request_id"):
        engine.abort("no-such-request")
    with pytest.raises(ValueError, match="string prompt"):
        engine.add_request("text without a tokenizer")
    with pytest.raises(ValueError, match="params"):
        engine.add_request([5], params={"max_tokens": 3})
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == running and len(outs[-1].output_token_ids) == 10


def test_prompt_beyond_kv_capacity(tiny_model):
    engine = Engine(tiny_model("llama"), num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="max_tokens.*KV blocks"):
        engine.add_request(_prompt(60), SamplingParams(max_tokens=10))
    engine.generate([_prompt(40)], SamplingParams(max_tokens=10))
    engine.check_invariants()


def test_generate_batch_with_one_bad_prompt_adds_nothing(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([_prompt(5), []], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


def test_add_requests_queues_all_or_nothing_under_the_callers_ids(engine):
    """Engine.add_requests (the engine process's entry): every prompt validated before any is
    queued, the caller's ids kept, each prompt's n - 1 siblings named by sibling_request_id;
    step() reports every token under those ids, the same tokens generate() gives."""
    from hf_paged.request_ids import sibling_request_id

    with pytest.raises(ValueError, match="empty"):
        engine.add_requests([_prompt(5), []], SamplingParams(max_tokens=2), ["a", "b"])
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="request_ids"):
        engine.add_requests([_prompt(5)], SamplingParams(max_tokens=2), ["a", "b"])
    params = SamplingParams(max_tokens=4, temperature=0.0, n=2)
    ids = engine.add_requests([_prompt(5), _prompt(7, 1)], params, ["a", "b"])
    assert ids == ["a", sibling_request_id("a", 1), "b", sibling_request_id("b", 1)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    want = engine.generate([_prompt(5), _prompt(7, 1)], params)
    assert list(tokens.values()) == [out.output_token_ids for out in want]


def test_bad_engine_options(tiny_model):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="block_size"):
        Engine(model, block_size=0)
    with pytest.raises(ValueError, match="unknown engine option"):
        Engine(model, max_batch=3)
    with pytest.raises(ValueError, match="scheduling_policy"):
        Engine(model, scheduling_policy="lifo")
    for name in ("cuda_graphs", "fuse_projections", "async_scheduling", "enable_prefix_caching"):
        with pytest.raises(ValueError, match=name):
            Engine(model, **{name: 1})
    with pytest.raises(ValueError, match="compile"):
        Engine(model, compile="yes")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(model, fuse_projections=True, kv_cache_dtype="int8")
    # a refused option leaves the model as it was: no fused layers, no hf_paged buffers
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert not any("hf_paged" in name for name, _ in model.named_buffers())


def test_patch_refuses_models_without_the_attention_interface():
    # Reformer's attention (local and LSH) calls no interface and hf_paged has no adapter for it
    config = transformers.ReformerConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        attn_layers=["local", "lsh"], axial_pos_embds=False, feed_forward_size=64,
        is_decoder=True,
    )  # fmt: skip
    model = transformers.ReformerModelWithLMHead(config).eval()
    with pytest.raises(ValueError, match="AttentionInterface.*no adapter"):
        hf_paged.patch(model)
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing left swapped


def test_generate_refuses_options_it_cannot_honour(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([4, 6])
    hf_paged.patch(model)
    try:
        with pytest.raises(ValueError, match="diversity_penalty"):
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                num_beams=4,
                num_beam_groups=2,
                diversity_penalty=1.0,
            )
        with pytest.raises(ValueError, match="epsilon_cutoff"):
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, epsilon_cutoff=0.1)
        with pytest.raises(ValueError, match="prefix_allowed_tokens_fn"):
            model.generate(
                input_ids=ids, attention_mask=mask, prefix_allowed_tokens_fn=lambda b, s: [3]
            )
        with pytest.raises(ValueError, match="row 1 is empty"):
            model.generate(input_ids=ids, attention_mask=torch.tensor([[1] * 6, [0] * 6]))
        with pytest.raises(ValueError, match="temperature"):
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.0)
        # still serving after the refusals
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
        assert out.shape == (2, 9)
        hf_paged.get_engine(model).check_invariants()
    finally:
        hf_paged.unpatch(model)


def test_unpatch_restores_transformers(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([4, 9])
    before = model.config._attn_implementation
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    hf_paged.patch(model)
    assert model.config._attn_implementation == "hf_paged"
    hf_paged.unpatch(model)
    assert model.config._attn_implementation == before and "generate" not in model.__dict__
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="not patched"):
        hf_paged.unpatch(model)


def test_patched_model_forward_outside_the_engine_is_plain_transformers(tiny_model, batch_factory):
    model = tiny_model("mistral")
    ids, mask = batch_factory([30, 12])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        hf_paged.patch(model)
        out = model(input_ids=ids, attention_mask=mask).logits
        hf_paged.unpatch(model)
    torch.testing.assert_close(out, ref)


def test_attention_arguments_that_change_semantics_are_refused(tiny_model):
    from hf_paged.worker.attention import _refuse_unsupported

    module = torch.nn.Module()
    with pytest.raises(ValueError, match="bidirectional"):
        _refuse_unsupported(module, {"is_causal": False})
    with pytest.raises(ValueError, match="position_bias"):
        _refuse_unsupported(module, {"position_bias": torch.zeros(2)})
    # attention sinks are implemented (tests/test_model_features.py)
    _refuse_unsupported(module, {"is_causal": True, "position_ids": torch.zeros(1), "s_aux": 1})
    # the module's is_causal=False: bidirectional, unless it is a decoder's attention keeping the
    # flag's default (BigBird-Pegasus's decoder, causal by its mask; the start-up check measures)
    module.is_causal = False
    with pytest.raises(ValueError, match="bidirectional"):
        _refuse_unsupported(module, {})
    module.is_decoder = True
    _refuse_unsupported(module, {})
    with pytest.raises(ValueError, match="bidirectional"):  # the call's own flag still counts
        _refuse_unsupported(module, {"is_causal": False})


def test_siblings_of_n_samples_count_against_max_num_seqs(tiny_model):
    """Regression: parents admitted in turn each fit, but their forked siblings together
    overflowed max_num_seqs (and the runner's rows)."""
    engine = Engine(tiny_model("llama"), max_num_seqs=4, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=6, n=3, seed=1)
    for prompt in ([5, 6, 7] * 5, [10, 11] * 6, [13] * 7):
        engine.add_request(prompt, params)
    finished = 0
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step())
        assert len(engine.scheduler.running) <= 4
    assert finished == 9
