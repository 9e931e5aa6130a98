"""Structured output (hf_paged.structured_output): every constraint kind on a tiny random model
with a small real BPE tokenizer, bad constraints, mixed batches, preemption, asynchronous
scheduling, grammar compilation off the step loop, generate() keywords and the pipeline."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import transformers

from hf_paged import Engine, SamplingParams, StructuredOutputs
from hf_paged.testing import tiny_tokenizer

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def json_tokenizer(vocab_size: int = 256):
    """testing.tiny_tokenizer with JSON's characters too."""
    return tiny_tokenizer(vocab_size, extra_chars='{}[]"-+_')


@pytest.fixture(scope="module")
def tok():
    return json_tokenizer()


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama")


def make_engine(model, tok, **options):
    options.setdefault("num_blocks", 64)
    options.setdefault("max_num_seqs", 8)
    return Engine(model, tok, **options)


def text(tok, out) -> str:
    return tok.decode(out.output_token_ids, skip_special_tokens=True).replace("▁", " ")


def constrained(max_tokens=80, temperature=0.7, seed=None, **kind):
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        structured=StructuredOutputs(**kind),
    )


def pydantic_model():
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):  # bounded, so a sampled row always ends within its tokens
        id: int = pydantic.Field(ge=0, le=999)
        label: str = pydantic.Field(max_length=8)

    return Item


def _run_to_end(eng):
    """Step until every request ends, checking the engine's invariants after each step; returns
    each request's final output by id."""
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        eng.check_invariants()
    return finals


def test_every_constraint_kind(model, tok):
    eng = make_engine(model, tok)
    item = pydantic_model()
    grammar = 'root ::= "x:" [0-9] [0-9]? "."'
    cases = [
        ("schema", dict(json=SCHEMA)),
        ("schema-text", dict(json=json.dumps(SCHEMA))),
        ("pydantic", dict(json=item)),
        ("any", dict(json_object=True)),
        ("regex", dict(regex=r"[a-c]{2,4}-\d{2}")),
        ("grammar", dict(grammar=grammar)),
        ("choice", dict(choice=["yes", "no", "maybe"])),
    ]
    params = [constrained(seed=i, **kind) for i, (_, kind) in enumerate(cases)]
    outs = eng.generate(["hello there"] * len(cases), params)
    for (name, _), out in zip(cases, outs):
        assert out.finish_reason == "stop", (name, text(tok, out))
        s = text(tok, out)
        if name in ("schema", "schema-text"):
            jsonschema.validate(json.loads(s), SCHEMA)
        elif name == "pydantic":
            item.model_validate_json(s)
        elif name == "any":
            json.loads(s)
        elif name == "regex":
            assert re.fullmatch(r"[a-c]{2,4}-\d{2}", s), s
        elif name == "grammar":
            assert re.fullmatch(r"x:\d\d?\.", s), s
        else:
            assert s in ("yes", "no", "maybe"), s


@pytest.mark.parametrize(
    "kind, match",
    [
        (dict(json={"type": 5}), "structured.json"),
        (dict(json="{not json"), "structured.json"),
        (dict(json=[1, 2]), "structured.json"),
        (dict(regex="(ab"), "structured.regex"),
        (dict(grammar='root ::= "a" undefined_rule'), "structured.grammar"),
        (dict(choice="yes"), "structured.choice"),
        (dict(choice=["a", 3]), "structured.choice"),
    ],
)
def test_bad_constraint_raises_naming_the_field(model, tok, kind, match):
    eng = make_engine(model, tok)
    with pytest.raises(ValueError, match=re.escape(match)):
        eng.add_request("hi", SamplingParams(structured=StructuredOutputs(**kind)))
    assert not eng.has_unfinished_requests()


def test_bad_options_with_structured(model, tok):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="structured must be"):
        SamplingParams(structured={"json": SCHEMA})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutputs(regex="a"))
    with pytest.raises(ValueError, match="prompt_lookup"):
        SamplingParams(prompt_lookup_num_tokens=3, structured=StructuredOutputs(regex="a"))
    eng = Engine(model, None, num_blocks=32)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request([5, 6], SamplingParams(structured=StructuredOutputs(regex="a")))


def test_compile_failure_ends_that_request_alone(model, tok, monkeypatch):
    """A constraint that parses but fails to compile: that request ends with the ValueError
    naming its field, the rest of the batch runs on, nothing leaks."""
    eng = make_engine(model, tok)
    eng.add_request("warm", constrained(regex="z"))  # builds the grammar service
    while eng.has_unfinished_requests():
        eng.step()
    compiler = eng.inputs.grammars._compiler
    real = compiler.compile_grammar

    def flaky(grammar):
        if "q" in str(grammar):
            raise RuntimeError("boom")
        return real(grammar)

    monkeypatch.setattr(eng.inputs.grammars, "_compiler", _Proxy(compiler, flaky))
    bad = eng.add_request("a", constrained(regex="qq"))
    good = eng.add_request("b", SamplingParams(max_tokens=5, temperature=0))
    also = eng.add_request("c", constrained(regex="[ab]{3}"))
    finals = _run_to_end(eng)
    assert finals[bad].finish_reason == "error"
    assert isinstance(finals[bad].error, ValueError)
    assert "structured.regex" in str(finals[bad].error)
    assert len(finals[good].output_token_ids) == 5
    assert re.fullmatch("[ab]{3}", text(tok, finals[also]))


class _Proxy:
    def __init__(self, inner, compile_grammar):
        self._inner, self.compile_grammar = inner, compile_grammar


def test_waiting_for_a_grammar_does_not_stall_the_batch(model, tok, monkeypatch):
    """A slow compilation: the request waits unscheduled; an unconstrained request added after
    it runs to completion meanwhile."""
    eng = make_engine(model, tok)
    eng.add_request("warm", constrained(regex="z"))
    while eng.has_unfinished_requests():
        eng.step()
    release = threading.Event()
    compiler = eng.inputs.grammars._compiler

    def slow(grammar):
        release.wait(10)
        return compiler.compile_grammar(grammar)

    monkeypatch.setattr(eng.inputs.grammars, "_compiler", _Proxy(compiler, slow))
    slow_id = eng.add_request("a", constrained(regex="[xy]{4}"))
    fast_id = eng.add_request("b", SamplingParams(max_tokens=6, temperature=0))
    done = {}
    for _ in range(50):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if fast_id in done:
            break
    assert fast_id in done and slow_id not in done
    assert eng.scheduler.requests[slow_id].num_computed_tokens == 0  # never scheduled
    release.set()
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        assert time.perf_counter() - t0 < 30
    assert re.fullmatch("[xy]{4}", text(tok, done[slow_id]))


def plain_rows():
    prompts = ["the cat", "a dog ran", "hello world again"]
    params = [SamplingParams(max_tokens=12, temperature=0) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_unconstrained_rows_unchanged_in_a_mixed_batch(model, tok, async_scheduling):
    prompts, params = plain_rows()
    ref = make_engine(model, tok, async_scheduling=async_scheduling).generate(prompts, params)
    eng = make_engine(model, tok, async_scheduling=async_scheduling)
    mixed_prompts = ["x", *prompts[:2], "y", prompts[2], "z"]
    mixed = [
        constrained(json=SCHEMA, seed=1),
        *params[:2],
        constrained(regex=r"\d{3}", temperature=0),
        params[2],
        constrained(choice=["red", "green"], seed=2),
    ]
    outs = eng.generate(mixed_prompts, mixed)
    plain = [outs[1], outs[2], outs[4]]
    assert [o.output_token_ids for o in plain] == [o.output_token_ids for o in ref]
    jsonschema.validate(json.loads(text(tok, outs[0])), SCHEMA)
    assert re.fullmatch(r"\d{3}", text(tok, outs[3]))
    assert text(tok, outs[5]) in ("red", "green")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_all_tokens_masked_fails_that_request_alone(model, tok, async_scheduling):
    """A grammar whose next character no token spells ('=' is not in the vocabulary): that
    request ends with a ValueError saying so; the others finish as usual."""
    eng = make_engine(model, tok, async_scheduling=async_scheduling)
    bad = eng.add_request("a", constrained(grammar='root ::= "x" "="', temperature=0))
    good = eng.add_request("b", SamplingParams(max_tokens=6, temperature=0))
    also = eng.add_request("c", constrained(regex="[ab]{3}"))
    finals = _run_to_end(eng)
    assert finals[bad].finish_reason == "error"
    assert "every allowed token was masked" in str(finals[bad].error)
    assert len(finals[good].output_token_ids) == 6
    assert re.fullmatch("[ab]{3}", text(tok, finals[also]))


def test_async_on_and_off_give_the_same_tokens(model, tok):
    prompts = ["one", "two", "three"]
    params = [
        constrained(json=SCHEMA, temperature=0),
        SamplingParams(max_tokens=10, temperature=0),
        constrained(regex=r"[a-f]{5}", temperature=0),
    ]
    runs = [
        [o.output_token_ids for o in make_engine(model, tok, async_scheduling=a).generate(
            prompts, params
        )]
        for a in (False, True)
    ]  # fmt: skip
    assert runs[0] == runs[1]
    eng = make_engine(model, tok, async_scheduling=True)
    (request,) = eng.inputs.make_requests("x", params[0])
    assert request.async_ok  # constrained requests run ahead (the runner lands tokens early)


def test_preemption_replays_the_matcher(model, tok):
    """Few KV blocks: requests are preempted and recomputed; their rebuilt rows replay the
    output tokens into fresh matchers, and every output still matches. Greedy outputs equal a
    run with room enough."""
    prompts = [f"request number {i} says" for i in range(6)]
    params = [constrained(json=SCHEMA, temperature=0, max_tokens=60) for _ in prompts]
    roomy = make_engine(model, tok, num_blocks=128).generate(prompts, params)
    eng = make_engine(model, tok, num_blocks=14, block_size=8, enable_prefix_caching=True)
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in roomy]
    for out in outs:
        jsonschema.validate(json.loads(text(tok, out)), SCHEMA)


def test_siblings_stop_strings_and_penalties(model, tok):
    eng = make_engine(model, tok)
    params = SamplingParams(
        max_tokens=80,
        temperature=1.0,
        top_k=20,
        top_p=0.9,
        repetition_penalty=1.3,
        n=3,
        seed=7,
        structured=StructuredOutputs(json=SCHEMA),
    )
    outs = eng.generate(["go"], params)
    assert len(outs) == 3
    for out in outs:
        jsonschema.validate(json.loads(text(tok, out)), SCHEMA)
    stop = SamplingParams(
        max_tokens=40,
        temperature=0,
        stop_strings=["-"],
        structured=StructuredOutputs(regex=r"[ab]{3}-[cd]{3}"),
    )
    (out,) = eng.generate(["go"], stop)
    assert re.fullmatch(r"[ab]{3}-", text(tok, out))


def test_generate_keywords_and_pipeline(model, tok):
    import hf_paged

    hf_paged.patch(model, num_blocks=64, max_num_seqs=8, tokenizer=tok)
    try:
        ids = tok(["hello", "a b c"], return_tensors="pt", padding=True)
        out = model.generate(**ids, max_new_tokens=20, regex=r"[0-9]{4}")
        for row in out[:, ids["input_ids"].shape[1] :]:
            assert re.fullmatch("[0-9]{4}", tok.decode(row, skip_special_tokens=True))
        out = model.generate(**ids, max_new_tokens=80, json_schema=SCHEMA, do_sample=True)
        for row in out[:, ids["input_ids"].shape[1] :]:
            s = tok.decode(row, skip_special_tokens=True).replace("▁", " ")
            jsonschema.validate(json.loads(s), SCHEMA)
        with pytest.raises(ValueError, match="regex"):
            model.generate(**ids, max_new_tokens=5, regex="(")
        with pytest.raises(ValueError, match="one structured output keyword"):
            model.generate(**ids, max_new_tokens=5, regex="a", choice=["b"])
        with pytest.raises(ValueError, match="beam"):
            model.generate(**ids, max_new_tokens=5, regex="a", num_beams=2)
        pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)
        res = pipe("hello", max_new_tokens=10, choice=["alpha", "beta"], return_full_text=False)
        assert res[0]["generated_text"].replace("▁", " ").strip() in ("alpha", "beta")
    finally:
        hf_paged.unpatch(model)


def test_nothing_runs_the_hook_without_constrained_rows(model, tok, monkeypatch):
    from hf_paged.structured_output.logits_mask import GrammarBitmask

    calls = []
    real = GrammarBitmask.apply
    monkeypatch.setattr(GrammarBitmask, "apply", lambda *a: calls.append(1) or real(*a))
    eng = make_engine(model, tok)
    eng.generate(["a", "b"], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    assert not calls
    eng.generate(["a"], constrained(regex="[ab]{2}"))
    assert calls
