"""What the sampler reads: one SamplingRow per request that samples, and what it returns.

A SamplingRow is the sampling side of one running request: its parameters and generator, its
token history (the runner appends each sampled token), and the caches that keep a step O(rows)
instead of O(tokens): the ban mask, the n-gram index, the row in the penalty count pool. The
runner's input batch owns the rows (built from the scheduler's NewRequestData, dropped when the
request leaves the running set); the sampler itself keeps nothing between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_paged.sampling_params import F_RECORD, F_RENORM, F_WARP, SamplingParams

# Stages that read no token history: a row with only these bits (or none, plain greedy) never
# looks at token_ids past its prompt, so the runner does not extend it (at 256 decoding rows that
# loop cost ~3% of a W1 step on the H200).
NO_HISTORY = F_WARP | F_RENORM | F_RECORD


@dataclass(slots=True, eq=False)
class SamplingRow:
    req_id: str
    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]  # prompt + known outputs (outputs only when needs_history)
    num_prompt_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # min_tokens masks them
    banned_token_ids: list[int] = field(default_factory=list)
    bad_word_prefixes: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    # n > 1: the siblings that sample their first token from this row's first logits
    siblings: list[SamplingRow] | None = None
    features: int = 0  # params.features, read once per row per step
    # structured output: the row's grammar matcher (hf_paged.structured_output RowMatcher)
    structured: object = None
    # -- caches, kept across steps --
    ban_mask: torch.Tensor | None = None  # banned_token_ids as a bool [V] row, built on first use
    penalty_slot: int = -1  # row in the penalty TokenCountPool; -1 = none yet
    penalty_num_counted: int = 0  # output tokens already added to that row
    # asynchronous scheduling: where this request's last sampled token is while the host has
    # not read it, an index into TokenCountPool.pending_tokens (the penalties count it on the
    # device), else -1; set by the runner for the step, consumed by the pool's sync
    pending_index: int = -1
    ngram_index: dict | None = None  # (n-1)-gram -> tokens that followed it (no_repeat_ngram)
    ngram_num_indexed: int = 0

    def __post_init__(self) -> None:
        self.features = self.params.features

    @property
    def needs_history(self) -> bool:
        return bool(self.features & ~NO_HISTORY)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SamplerOutput:
    """tokens[i] for rows[i] (int64 on the logits' device; -1 for a beam row). The dicts are
    keyed by request id and None when no row asked for them."""

    tokens: torch.Tensor
    fork_tokens: dict[str, int] | None = None  # sibling id -> its first token (parent's row)
    failed: dict[str, BaseException] | None = None  # what a row's logits processor raised
    logprobs: dict[str, dict[int, float]] | None = None  # {token: logprob}: sampled + top-n
    scores: dict[str, torch.Tensor] | None = None  # processed scores row [V]
    logits: dict[str, torch.Tensor] | None = None  # raw logits row [V]
    beam_logits: dict[str, torch.Tensor] | None = None  # beam rows, float32 [V], not sampled

    def runner_output_fields(self) -> dict:
        """What the runner's ModelRunnerOutput carries of it, by its field names."""
        return dict(
            fork_token_ids=self.fork_tokens,
            failed=self.failed,
            logprobs=self.logprobs,
            scores=self.scores,
            logits=self.logits,
            beam_logits=self.beam_logits,
        )
