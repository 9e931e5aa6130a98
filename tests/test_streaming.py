"""Streaming: transformers streamers through patched generate, and the Engine iterator."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

import hf_paged
from hf_paged import Engine, SamplingParams
from hf_paged.testing import tiny_tokenizer


class Recorder(BaseStreamer):
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.clone())

    def end(self):
        self.calls.append("end")


def test_text_streamer_prints_what_transformers_prints(tiny_model, capsys):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    ids = tok("hello there", return_tensors="pt")["input_ids"]
    ref = model.generate(
        ids, max_new_tokens=12, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True)
    )
    ref_text = capsys.readouterr().out
    hf_paged.patch(model, tok)
    try:
        out = model.generate(ids, max_new_tokens=12, streamer=TextStreamer(tok, skip_prompt=True))
    finally:
        hf_paged.unpatch(model)
    text = capsys.readouterr().out
    assert torch.equal(out, ref)
    assert text == ref_text
    assert text.strip() == tok.decode(out[0, ids.shape[1] :]).strip()


def test_iterator_streamer_text_equals_final_output(tiny_model):
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    ids = tok("stream me", return_tensors="pt")["input_ids"]
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    hf_paged.patch(model)
    try:
        result = {}
        thread = threading.Thread(
            target=lambda: result.setdefault(
                "out", model.generate(ids, max_new_tokens=15, streamer=streamer)
            )
        )
        thread.start()
        pieces = list(streamer)
        thread.join()
    finally:
        hf_paged.unpatch(model)
    assert "".join(pieces) == tok.decode(result["out"][0, ids.shape[1] :])


def test_streamer_calls_match_transformers_for_a_batch(tiny_model, batch_factory):
    """Batch streamers get put(input_ids), one [batch] tensor per step (pad after a row ends),
    end() — the same calls transformers makes, though rows run at their own pace inside."""
    model = tiny_model("llama")
    ids, mask = batch_factory([4, 12, 7], seed=31)
    plain = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    eos = int(plain[0, ids.shape[1] + 2])
    gen = dict(do_sample=False, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    ref_rec, rec = Recorder(), Recorder()
    model.generate(input_ids=ids, attention_mask=mask, streamer=ref_rec, **gen)
    hf_paged.patch(model, max_num_batched_tokens=8)  # chunked prefill: rows start apart
    try:
        model.generate(input_ids=ids, attention_mask=mask, streamer=rec, **gen)
    finally:
        hf_paged.unpatch(model)
    assert len(rec.calls) == len(ref_rec.calls)
    for a, b in zip(rec.calls, ref_rec.calls):
        if isinstance(b, str):
            assert a == b
        else:
            assert torch.equal(a, b)


def test_text_streamer_refuses_a_batch_and_nothing_leaks(tiny_model, batch_factory):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    ids, mask = batch_factory([3, 5])
    hf_paged.patch(model)
    try:
        with pytest.raises(ValueError, match="batch size 1"):
            model.generate(input_ids=ids, attention_mask=mask, streamer=TextStreamer(tok))
        assert not hf_paged.get_engine(model).has_unfinished_requests()
    finally:
        hf_paged.unpatch(model)


def test_engine_stream_interleaves_many_requests(tiny_model):
    engine = Engine(tiny_model("llama"), max_num_batched_tokens=64)
    prompts = [[3 + i] * (5 + 3 * i) for i in range(8)]
    params = [SamplingParams(max_tokens=4 + i, temperature=0) for i in range(8)]
    seen: dict[str, list[int]] = {}
    order = []
    with engine.stream(prompts, params) as stream:
        ids = stream.request_ids
        for out in stream:
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
            order.append(out.request_id)
            if out.finished:
                assert seen[out.request_id] == out.output_token_ids
    assert set(seen) == set(ids) and len(ids) == 8
    assert [len(seen[r]) for r in ids] == [4 + i for i in range(8)]
    first_done = order.index(ids[0]) + 3  # request 0 finishes after its 4th token...
    assert len(set(order[:first_done])) > 1  # ...while the others were streaming too
    final = engine.generate(prompts, params)
    assert [o.output_token_ids for o in final] == [seen[r] for r in ids]


def test_closing_a_stream_early_aborts_its_requests(tiny_model):
    engine = Engine(tiny_model("llama"))
    stream = engine.stream([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=50, n=2))
    next(stream)
    stream.close()
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
