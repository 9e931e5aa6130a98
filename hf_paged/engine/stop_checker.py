"""Stop conditions beyond end-of-sequence ids and lengths: stop strings and user criteria.

The output processor runs both per request after it gets a token (the scheduler checks only
end-of-sequence/stop ids and lengths), with transformers' semantics on the request's own
tokens ([1, num_tokens], no padding). Stop strings use transformers' StopStringCriteria, which
matches on the tokenizer's vocabulary (a stop string must overlap the last token, as there), and
only looks at the last `maximum_token_len` tokens, so it costs O(1) per step. A user
StoppingCriteria costs what it costs in transformers, once per request per step; it gets the
request's `scores` as a tuple of [1, V] rows when the request keeps them (output_scores), else None.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from hf_paged.core.request import Request
from hf_paged.sampling_params import SamplingParams


def build_stop_checkers(params: SamplingParams, tokenizer) -> list | None:
    """The request's extra stop checks, or None. Raises ValueError for stop strings without a
    tokenizer (they are matched against its vocabulary)."""
    checkers = []
    if params.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings: matching stop strings needs Engine(model, tokenizer)")
        checkers.append(StopStringCriteria(tokenizer, params.stop_strings))
    if params.stopping_criteria:
        checkers.append(StoppingCriteriaList(params.stopping_criteria))
    return checkers or None


def first_stop(request: Request) -> int | None:
    """The request got request.num_new_tokens tokens this step (several after a speculative
    verify step): the length at which a stop string or criterion first stops it, or None. Each
    new token is checked as if it had come alone, so a stop inside an accepted run cuts it."""
    total = len(request.all_token_ids)
    for length in range(total - max(request.num_new_tokens, 1) + 1, total + 1):
        if should_stop(request, length):
            return length
    return None


def should_stop(request: Request, length: int | None = None) -> bool:
    """Do the request's stop checks stop it at its first `length` tokens (default: all)?"""
    tokens = request.all_token_ids
    if length is not None and length < len(tokens):
        tokens = tokens[:length]
    scores = None
    if request.output_scores is not None:
        scores = tuple(row[None] for row in request.output_scores)
    for checker in request.stop_checkers:
        if isinstance(checker, StopStringCriteria):
            window = tokens[-checker.maximum_token_len :]
            ids = torch.tensor([window], dtype=torch.long)
        else:
            ids = torch.tensor([tokens], dtype=torch.long)
            if scores is not None:
                ids = ids.to(scores[0].device)
        done = checker(ids, scores)
        if bool(torch.as_tensor(done).any()):
            return True
    return False
