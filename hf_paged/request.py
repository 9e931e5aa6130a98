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

    @property
    def finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


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
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first schedule; -1 = not scheduled yet
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # seeded requests sample from their own stream
    prompt_logprobs: list[float | None] | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # hashes of this request's full blocks, computed incrementally (prefix caching)
    block_hashes: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

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
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    prompt_logprobs: list[float | None] | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
