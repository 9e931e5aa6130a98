"""Speculative decoding in the scheduler: which proposals a step verifies, the slots a draft
model writes ahead, and a verify step's tokens applied to a request.

The runner proposes tokens for a request after a step (Request.spec_token_ids); the next step
schedules them after the request's last token, in the token budget and KV allocation like any
other token (vLLM V1's num_spec_tokens). The verify step keeps a prefix of them; progress rolls
back past the rest.
"""

from __future__ import annotations

from hf_paged.core.request import Request


def scheduled_proposals(request: Request, num_new: int, budget: int) -> list[int]:
    """The proposals scheduled after a decoding request's last token: as many as the token
    budget and the request's length limit leave room for (a verify step gives up to
    len(proposals) + 1 tokens). A request's proposals are consumed by one schedule, whether
    they are scheduled or not."""
    spec = request.spec_token_ids
    if not spec:
        return spec
    request.spec_token_ids = []
    if num_new != 1 or request.num_pending:
        return []
    room = min(budget - 1, request.max_total_tokens - request.num_tokens - 1)
    return spec[: max(room, 0)]


def lookahead(request: Request, end: int, num_lookahead_tokens: int) -> int:
    """Slots past the step's tokens (which end at position `end`) that a draft model writes
    while it proposes for the next step (its KV for the tokens it feeds itself), within the
    request's length limit."""
    if not num_lookahead_tokens:
        return 0
    return max(0, min(num_lookahead_tokens, request.max_total_tokens - end))


def append_verified(request: Request, proposed: list[int], accepted: dict) -> None:
    """A verify step: the request computed its last token and `proposed`; the target kept the
    first few proposals and added its own token (accepted[request id]). Progress rolls back
    past the rejected proposals (their slots are written again by the next step; the prefix
    cache hashes only known tokens, so it never saw them). An end-of-sequence or stop id, or
    the length limit, inside the accepted run cuts it there (the caller's stop check then ends
    the request)."""
    tokens = accepted[request.request_id]
    num_accepted = len(tokens) - 1
    request.num_computed_tokens -= len(proposed) - num_accepted
    request.num_spec_proposed += len(proposed)
    request.num_spec_accepted += num_accepted
    count = 0
    for token in tokens:
        request.all_token_ids.append(token)
        count += 1
        if token in request.eos_token_ids or len(request.all_token_ids) >= request.max_total_tokens:
            break
    request.num_new_tokens = count
