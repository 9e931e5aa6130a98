"""A request's state inside the engine. `num_computed_tokens` is its only progress counter."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from hf_paged.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # an end-of-sequence or stop token
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # user code (a stopping criterion, a logits processor) raised


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

# Plain attributes per member rather than properties or dict lookups: `status.finished` is read
# several times per request per step, and an enum property or hash costs ~1 us each.
for _status in RequestStatus:
    _status.finished = _status.value >= RequestStatus.FINISHED_STOPPED.value
    _status.reason = FINISH_REASONS.get(_status)
del _status


@dataclass(slots=True, eq=False)
class Request:
    """Prompt, outputs so far and progress. There is no prefill or decode phase: a step computes
    some of the tokens in all_token_ids[num_computed_tokens:], and a token is sampled only when a
    step reaches the end of all_token_ids."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # resolved at add_request; empty when ignore_eos
    max_total_tokens: int  # prompt + max new tokens, capped by max_model_len
    priority: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    arrival_index: int = 0  # tie-break for equal arrival times (FCFS order)
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    # Asynchronous scheduling: tokens sampled by launched steps whose values have not reached the
    # host yet. They count in num_tokens (the next step computes them) but are not in
    # all_token_ids; the step's output appends them. Always 0 between synchronous steps.
    num_pending: int = 0
    async_ok: bool = True  # no option that reads the token history on the host while sampling
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first schedule; -1 = not scheduled yet
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # seeded requests sample from their own stream
    prompt_logprobs: list[float | None] | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # hashes of this request's full blocks, computed incrementally (prefix caching)
    block_hashes: list = field(default_factory=list)
    # -- sampling inputs, resolved at add_request and handed to the runner (NewRequestData) --
    banned_token_ids: list[int] = field(default_factory=list)  # suppress_tokens + 1-token bad words
    bad_word_prefixes: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    in_runner: bool = False  # the runner holds a row for it (the scheduler's bookkeeping)
    # structured output: its grammar (hf_paged.structured_output GrammarHandle), compiled in the
    # background; the scheduler starts the request only once the grammar is ready
    grammar: object = None
    # -- the engine's output side (engine/output_processor.py): stop checks and what the
    # request asked to keep, filled from the runner's outputs --
    stop_checkers: list | None = None  # stop-string and user stopping criteria, built at add
    output_scores: list[torch.Tensor] | None = None  # processed scores row per new token
    output_logits: list[torch.Tensor] | None = None  # raw logits row per new token
    output_logprobs: list[dict[int, float]] | None = None  # {token: logprob} per new token
    # n > 1: siblings wait (holding no blocks) until this request's prompt is computed, then fork
    # its blocks by reference count and sample their first token from the same logits row
    pending_siblings: list[Request] | None = None
    sibling_index: int = 0
    parent_request_id: str | None = None
    error: BaseException | None = None  # FINISHED_ERROR: what the user's code raised
    # -- speculative decoding: the runner's proposals for the next step (scheduled after the
    # request's last token and verified by the target), and the request's counts --
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_proposed: int = 0  # proposals verified
    num_spec_accepted: int = 0  # of those, accepted
    num_new_tokens: int = 0  # tokens the last step appended (more than 1 after a verify)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus tokens sampled on the GPU but not yet known (num_pending)."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def finish_reason(self) -> str | None:
        return self.status.reason

    def sort_key(self, policy: str) -> tuple:
        """Smaller = served first. FCFS: arrival order. Priority: priority value, then arrival."""
        if policy == "priority":
            return (self.priority, self.arrival_time, self.arrival_index)
        return (self.arrival_time, self.arrival_index)


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for a request after a step (or at the end of generate)."""

    request_id: str
    prompt_token_ids: list[int]
    # The request's own token list (append-only) and its length at this output: output_token_ids
    # is sliced on access, so reporting a step costs O(1) per request instead of O(output length).
    token_ids_ref: list[int] = field(repr=False)
    num_tokens: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    prompt_logprobs: list[float | None] | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    logprobs: list[dict[int, float]] | None = None  # SamplingParams.logprobs: per new token
    index: int = 0  # sibling index among the n samples of one prompt
    scores: list[torch.Tensor] | None = None  # SamplingParams.output_scores: [V] per new token
    logits: list[torch.Tensor] | None = None  # SamplingParams.output_logits: [V] per new token
    parent_request_id: str | None = None  # the first sibling's id (None for it)
    # finish_reason "error": the exception the request's own user code raised (a stopping
    # criterion or logits processor); generate() and Engine.generate re-raise it
    error: BaseException | None = None
    tokenizer: object = field(default=None, repr=False, compare=False)  # the engine's, for text
    # speculative decoding: proposed tokens the target verified, and how many it accepted
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed speculative tokens; None when nothing was proposed."""
        if not self.num_spec_proposed:
            return None
        return self.num_spec_accepted / self.num_spec_proposed

    @property
    def text(self) -> str | None:
        """The generated tokens as text (the engine's tokenizer, special tokens skipped); None
        without a tokenizer. Decoded when read, so outputs nobody reads as text cost nothing."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(self.output_token_ids, skip_special_tokens=True)

    @property
    def output_token_ids(self) -> list[int]:
        """Every token generated up to this output."""
        return self.token_ids_ref[len(self.prompt_token_ids) : self.num_tokens]
