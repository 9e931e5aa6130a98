"""What crosses the scheduler -> runner -> scheduler boundary, one step at a time.

The runner never sees a Request: the scheduler hands it a ScheduledBatch of plain data (ids,
counts, block ids, and for requests the runner does not hold yet, their tokens and sampling
inputs), and the runner returns a ModelRunnerOutput of plain data (tokens, and what requests asked
to keep: logprobs, scores, logits rows). The scheduler's own view of the step (its Request
objects, in batch order) stays in the SchedulerOutput that wraps the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_paged.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner holds nothing for: scheduled for the first time, resumed after
    preemption, or whose token history or block table was rewritten (a beam step, a fork, a
    copy-on-write). The runner builds its row and its sampling state from this."""

    req_id: str
    token_ids: list[int]  # the known tokens: prompt + outputs so far (a copy)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None  # seeded requests: their own stream, shared by reference
    stop_token_ids: frozenset[int]  # end-of-sequence and stop ids (min_tokens masks them)
    banned_token_ids: list[int]  # suppress_tokens + one-token bad words
    bad_word_prefixes: list[tuple[tuple[int, ...], int]]  # longer bad words: (prefix, last)
    # n > 1: the siblings that sample their first token from this request's first logits row
    siblings: list[NewRequestData] | None = None
    max_total_tokens: int = 0  # prompt + max new tokens: speculation proposes no further
    grammar: object = None  # structured output: the request's xgrammar CompiledGrammar


@dataclass(slots=True)
class ScheduledBatch:
    """The runner's input for one step. Entry i of each list is the i-th scheduled request."""

    req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    # known + pending tokens: a request samples when the step reaches this many
    num_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # the KV manager's lists, read-only
    new_requests: list[NewRequestData] = field(default_factory=list)
    # requests the runner must drop before this step (ended, preempted, or rewritten: a
    # rewritten one comes back in new_requests)
    released_req_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write: src, dst
    # speculative decoding: request id -> the proposed tokens scheduled after its last known
    # token (they are in num_scheduled_tokens, not in num_tokens); None when none
    spec_token_ids: dict[str, list[int]] | None = None

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """The step as the scheduler sees it: its requests in batch order (what update_from_output
    reads) and the batch handed to the runner."""

    requests: list = field(default_factory=list)  # core.request.Request, batch order
    batch: ScheduledBatch = field(default_factory=ScheduledBatch)
    preempted: list = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> list[int]:
        return self.batch.num_scheduled_tokens

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.batch.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(slots=True)
class ModelRunnerOutput:
    """sampled_token_ids[i] belongs to the batch's i-th request; -1 where nothing was sampled (a
    prefill chunk that does not reach the end of the request's tokens, or a beam row). The dicts
    are keyed by request id and None when empty."""

    sampled_token_ids: list[int]
    # n > 1: sibling request id -> its first token, sampled from its parent's first logits row
    # (a sibling aborted meanwhile has one too: the runner's list of siblings is its parent's
    # at admission; the scheduler takes the tokens of the siblings still pending)
    fork_token_ids: dict[str, int] | None = None
    # request id -> what its own user code (a logits processor) raised; its token is void
    failed: dict[str, BaseException] | None = None
    logprobs: dict[str, dict[int, float]] | None = None  # the sampled token + the top-n
    scores: dict[str, torch.Tensor] | None = None  # processed scores row [V]
    logits: dict[str, torch.Tensor] | None = None  # raw logits row [V]
    beam_logits: dict[str, torch.Tensor] | None = None  # beam rows: float32 [V], not sampled
    # prompt log-probs computed this step: request id -> (first prompt position, values)
    prompt_logprobs: dict[str, tuple[int, list[float]]] | None = None
    # speculative decoding: request id -> every token a verified request got this step (its
    # accepted proposals, then the target's own token; sampled_token_ids holds the last one)
    accepted_token_ids: dict[str, list[int]] | None = None
    # request id -> the proposals for its next step
    spec_token_ids: dict[str, list[int]] | None = None

    @classmethod
    def from_rows(cls, num_seqs: int, sample_rows: list[int], tokens: list[int], **extra):
        """tokens[j] was sampled by request sample_rows[j]; the others sampled nothing."""
        if len(sample_rows) == num_seqs:  # a decode step: every request sampled, in order
            sampled = list(tokens)
        else:
            sampled = [-1] * num_seqs
            for i, t in zip(sample_rows, tokens):
                sampled[i] = t
        return cls(sampled_token_ids=sampled, **extra)
