"""pipeline("text-generation", backend="paged") equals transformers' pipeline (greedy), and puts
all inputs of a call through continuous batching at once."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged
from hf_paged.generation.pipelines import PagedTextGenerationPipeline
from hf_paged.testing import tiny_tokenizer

TEXTS = ["hello there", "the quick brown fox jumps over", "a", "zebra crossing at noon"]
CHAT = [{"role": "user", "content": "hi how are you"}]
CHATS = [
    CHAT,
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what"}],
    [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "once upon"}],
]
GEN = dict(max_new_tokens=8, do_sample=False)


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama")


def test_outputs_equal_transformers_pipeline(model):
    tok = tiny_tokenizer()
    ref_pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok)
    calls = [
        (TEXTS[0], GEN),
        (TEXTS, GEN),
        (CHAT, GEN),
        (CHATS, GEN),
        (TEXTS, dict(GEN, return_full_text=False)),
        (TEXTS[:2], dict(GEN, return_tensors=True)),
        (TEXTS, dict(max_length=34, do_sample=False)),  # per-input length semantics
        (TEXTS, dict(GEN, repetition_penalty=1.4, prefix="once ")),
    ]
    refs = [ref_pipe(x, **kw) for x, kw in calls]
    pipe = hf_paged.pipeline("text-generation", model=model, tokenizer=tok)
    assert isinstance(pipe, PagedTextGenerationPipeline)
    for (x, kw), ref in zip(calls, refs):
        out = pipe(x, **kw)
        if kw.get("return_tensors"):
            assert all(
                torch.equal(
                    torch.as_tensor(a[0]["generated_token_ids"]),
                    torch.as_tensor(b[0]["generated_token_ids"]),
                )
                for a, b in zip(out, ref)
            )
        else:
            assert out == ref, (x, kw)


def test_transformers_pipeline_backend_switch(model):
    tok = tiny_tokenizer()
    plain = transformers.pipeline("text-generation", model=model, tokenizer=tok)
    assert type(plain) is transformers.TextGenerationPipeline  # no backend: unchanged
    hf = transformers.pipeline("text-generation", model=model, tokenizer=tok, backend="hf")
    assert type(hf) is transformers.TextGenerationPipeline
    ref = plain(TEXTS, **GEN)
    paged = transformers.pipeline(
        "text-generation",
        model=model,
        tokenizer=tok,
        backend="paged",
        engine_options={"block_size": 8},
    )
    assert isinstance(paged, PagedTextGenerationPipeline)
    assert paged(TEXTS, **GEN) == ref
    with pytest.raises(ValueError, match="backend"):
        transformers.pipeline("text-generation", model=model, tokenizer=tok, backend="vllm")


def test_all_inputs_share_continuous_batching(model):
    tok = tiny_tokenizer()
    pipe = hf_paged.pipeline("text-generation", model=model, tokenizer=tok)
    engine = hf_paged.get_engine(pipe.model)
    before = engine.num_steps
    out = pipe(TEXTS * 4, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    steps = engine.num_steps - before
    assert len(out) == 16 and steps == 6  # one step per token for all 16, not 16 x 6
    gen_out = list(pipe((t for t in TEXTS), max_new_tokens=3, do_sample=False))  # generator input
    assert [o[0]["generated_text"] for o in gen_out] == [
        o[0]["generated_text"] for o in pipe(TEXTS, max_new_tokens=3, do_sample=False)
    ]
    engine.check_invariants()


def test_sampling_return_sequences(model):
    pipe = hf_paged.pipeline("text-generation", model=model, tokenizer=tiny_tokenizer())
    torch.manual_seed(0)
    out = pipe(TEXTS[:2], max_new_tokens=5, do_sample=True, num_return_sequences=3)
    assert [len(o) for o in out] == [3, 3]
    assert all(
        o["generated_text"].startswith(t)
        for o, t in ((o, t) for group, t in zip(out, TEXTS) for o in group)
    )
