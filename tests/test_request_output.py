"""make_output builds RequestOutput positionally (a step builds one per running request): every
field must still come from the request attribute of the same meaning."""

from __future__ import annotations

import dataclasses

from hf_paged import SamplingParams
from hf_paged.core.request import Request, RequestOutput, RequestStatus
from hf_paged.engine.output_processor import make_output


def test_make_output_fills_every_field_from_its_request_attribute():
    r = Request("req-7", [5, 6, 7], SamplingParams(max_tokens=9), frozenset({2}), 12)
    r.all_token_ids += [11, 12, 13]
    r.status = RequestStatus.FINISHED_LENGTH
    r.num_cached_tokens = 3
    r.prompt_logprobs = [None, -0.5, -0.25]
    r.arrival_time, r.first_token_time, r.finish_time = 1.5, 2.5, 3.5
    r.output_logprobs = [{11: -0.1}, {12: -0.2}, {13: -0.3}]
    r.sibling_index, r.parent_request_id = 4, "req-3"
    r.output_scores, r.output_logits = ["scores"], ["logits"]
    r.error = ValueError("boom")
    r.num_spec_proposed, r.num_spec_accepted = 10, 6
    tokenizer = object()
    out = make_output(r, 2, tokenizer)
    expected = {
        "request_id": "req-7",
        "prompt_token_ids": [5, 6, 7],
        "token_ids_ref": r.all_token_ids,
        "num_tokens": 6,
        "new_token_ids": [12, 13],
        "finished": True,
        "finish_reason": "length",
        "num_cached_tokens": 3,
        "prompt_logprobs": r.prompt_logprobs,
        "arrival_time": 1.5,
        "first_token_time": 2.5,
        "finish_time": 3.5,
        "logprobs": r.output_logprobs,
        "index": 4,
        "scores": ["scores"],
        "logits": ["logits"],
        "parent_request_id": "req-3",
        "error": r.error,
        "tokenizer": tokenizer,
        "num_spec_proposed": 10,
        "num_spec_accepted": 6,
    }
    # a field added to RequestOutput must be added here (and to make_output's positions)
    assert [f.name for f in dataclasses.fields(RequestOutput)] == list(expected)
    for name, value in expected.items():
        assert getattr(out, name) == value, name
    assert out.output_token_ids == [11, 12, 13]
    # a request that got no token (an error output) reports no new ones; cached -1 reads as 0
    r.num_cached_tokens = -1
    none = make_output(r, 0)
    assert none.new_token_ids == [] and none.num_cached_tokens == 0 and none.tokenizer is None
