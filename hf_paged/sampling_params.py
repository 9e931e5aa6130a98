"""Per-request generation options: vLLM's SamplingParams, with transformers' meaning per field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Feature bits: the sampler ORs the bits of a batch's requests once per step and runs only the
# stages some row needs, so a batch without penalties or filters pays nothing for them.
F_REPETITION = 1 << 0  # repetition_penalty (prompt + output tokens, transformers)
F_PRESENCE = 1 << 1  # presence/frequency penalties (output tokens, vLLM)
F_NGRAM = 1 << 2
F_BAN = 1 << 3  # bad_words_ids, suppress_tokens, begin_suppress_tokens, min_tokens, forced eos
F_USER = 1 << 4  # user logits processors (Python, per request)
F_WARP = 1 << 5  # a sampling row: temperature / top-k / top-p / min-p / typical-p
F_RENORM = 1 << 6
F_RECORD = 1 << 7  # output_scores / output_logits / logprobs
F_FORK = 1 << 8  # n > 1: siblings sample their first token from the parent's logits row
# a beam: its logits row goes to hf_paged.generation.beam_search, not to the sampler
F_BEAM = 1 << 9
# a grammar constraint (hf_paged.structured_output): the sampler masks the row's logits
F_STRUCTURED = 1 << 10


def _ints(name: str, ids, allow_empty: bool = True) -> list[int]:
    try:
        out = [int(i) for i in ids]
        ok = all(isinstance(i, int) or float(i).is_integer() for i in ids)
    except (TypeError, ValueError):
        ok = False
    if not ok or any(i < 0 for i in out) or (not out and not allow_empty):
        raise ValueError(f"{name} must be a list of non-negative integer token ids, got {ids!r}")
    return out


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and stops. Validated on construction: bad values raise ValueError.

    Logits go through transformers' processors in transformers' order: repetition_penalty, then
    (vLLM's) presence/frequency penalties, no_repeat_ngram_size, bad_words_ids, min_tokens,
    suppress_tokens, begin_suppress_tokens, the user's logits_processors; then, for sampling rows
    only (temperature > 0), temperature, top-k, top-p, min-p, typical-p. temperature 0 = greedy.
    """

    max_tokens: int = 16
    min_tokens: int = 0  # end-of-sequence/stop ids are masked until this many tokens exist
    n: int = 1  # independent samples of the prompt; siblings share the prompt's KV blocks
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    typical_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # transformers' rule, over prompt and output tokens
    presence_penalty: float = 0.0  # vLLM's rule, over output tokens
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: list[list[int]] | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None  # masked for the first new token only
    # transformers' forced_eos_token_id: the last new token (the max_tokens-th) is forced to this
    # id (one of these ids), after the bans and before suppress_tokens, as its processor does
    forced_eos_token_id: int | list[int] | None = None
    renormalize_logits: bool = False
    seed: int | None = None  # per-request generator: output independent of the rest of the batch
    ignore_eos: bool = False
    # None: the engine's default end-of-sequence ids (the model's generation_config)
    eos_token_id: int | list[int] | None = None
    stop_token_ids: list[int] | None = None  # extra ids that end the request (kept in the output)
    stop_strings: list[str] | None = None  # needs the engine's tokenizer; kept in the output
    prompt_logprobs: bool = False  # return log p(prompt[i] | prompt[:i]) for every prompt token
    logprobs: int | None = None  # per new token: its log-prob and the top-n (raw model output)
    output_scores: bool = False  # keep each step's processed scores row (transformers' `scores`)
    output_logits: bool = False  # keep each step's raw logits row (transformers' `logits`)
    # transformers LogitsProcessor / StoppingCriteria objects, called per request with the
    # request's own token ids ([1, num_tokens], no padding): a Python call per request per step.
    logits_processors: list | None = None
    stopping_criteria: list | None = None
    # a PeftModel's LoRA adapter for this request (peft's adapter name); None or "__base__": the
    # base model. Requests with different adapters share a batch (hf_paged.lora)
    adapter: str | None = None
    # prompt lookup (speculative decoding without a draft model, transformers' meaning): up to
    # this many tokens that followed the last match of the request's last 1..max_matching_
    # ngram_size tokens in its own prompt and output are proposed and verified in one forward
    prompt_lookup_num_tokens: int = 0
    max_matching_ngram_size: int = 2
    # structured output (hf_paged.structured_output.StructuredOutputs): a JSON schema, any JSON,
    # a regex, an EBNF grammar or a choice list the output must match; needs the engine's
    # tokenizer and the `structured` extra (xgrammar)
    structured: object = None
    # internal: set by hf_paged.generation.beam_search for its beam requests
    beam_search: bool = False
    features: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def integer(name: str, low: int) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

        def number(name: str, ok, rule: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{name} must be a number {rule}, got {value!r}")
            if not ok(value):
                raise ValueError(f"{name} must be {rule}, got {value!r}")
            return float(value)

        integer("max_tokens", 1)
        integer("min_tokens", 0)
        integer("n", 1)
        integer("top_k", 0)
        integer("no_repeat_ngram_size", 0)
        integer("prompt_lookup_num_tokens", 0)
        integer("max_matching_ngram_size", 1)
        self.temperature = number("temperature", lambda t: 0 <= t < math.inf, "finite and >= 0")
        self.top_p = number("top_p", lambda p: 0 < p <= 1, "in (0, 1]")
        self.min_p = number("min_p", lambda p: 0 <= p <= 1, "in [0, 1]")
        self.typical_p = number("typical_p", lambda p: 0 < p <= 1, "in (0, 1]")
        self.repetition_penalty = number(
            "repetition_penalty", lambda p: 0 < p < math.inf, "finite and > 0"
        )
        self.presence_penalty = number("presence_penalty", math.isfinite, "finite")
        self.frequency_penalty = number("frequency_penalty", math.isfinite, "finite")
        seed = self.seed
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None:
            integer("logprobs", 0)
        if self.adapter == "__base__":
            self.adapter = None
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(
                f"adapter must be an adapter name (a str) or None, got {self.adapter!r}"
            )
        for name in ("eos_token_id", "forced_eos_token_id"):
            if isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool):
                setattr(self, name, [getattr(self, name)])
        for name in (
            "eos_token_id",
            "forced_eos_token_id",
            "stop_token_ids",
            "suppress_tokens",
            "begin_suppress_tokens",
        ):
            ids = getattr(self, name)
            if ids is not None:
                setattr(self, name, _ints(name, ids))
        if self.bad_words_ids is not None:
            if not isinstance(self.bad_words_ids, (list, tuple)) or not self.bad_words_ids:
                raise ValueError(
                    f"bad_words_ids must be a non-empty list of lists, got {self.bad_words_ids!r}"
                )
            for seq in self.bad_words_ids:
                if not isinstance(seq, (list, tuple)):
                    raise ValueError(f"bad_words_ids must be a list of lists, got {seq!r} inside")
            self.bad_words_ids = [_ints("bad_words_ids", s, False) for s in self.bad_words_ids]
        if isinstance(self.stop_strings, str):
            self.stop_strings = [self.stop_strings]
        if self.stop_strings is not None:
            stops = self.stop_strings
            if not stops or not all(isinstance(s, str) and s for s in stops):
                raise ValueError(f"stop_strings must be non-empty strings, got {stops!r}")
            self.stop_strings = list(self.stop_strings)
        for name in ("logits_processors", "stopping_criteria"):
            items = getattr(self, name)
            if items is not None:
                if not all(callable(x) for x in items):
                    raise ValueError(f"{name} must be a list of callables, got {items!r}")
                setattr(self, name, list(items) or None)
        if self.structured is not None:
            self._check_structured()
        self.features = self._compute_features()

    def _check_structured(self) -> None:
        from hf_paged.structured_output.constraint import StructuredOutputs

        if not isinstance(self.structured, StructuredOutputs):
            raise ValueError(
                "structured must be a hf_paged.StructuredOutputs or None, got "
                f"{type(self.structured).__name__}"
            )
        if self.beam_search:
            raise ValueError("structured: not supported with beam search (num_beams > 1)")
        if self.prompt_lookup_num_tokens:
            raise ValueError(
                "structured: not supported with prompt_lookup_num_tokens (speculation is off "
                "for constrained requests)"
            )
        if self.ignore_eos:
            raise ValueError(
                "structured: needs an end-of-sequence token to end on (ignore_eos=True leaves none)"
            )

    def _compute_features(self) -> int:
        f = 0
        if self.repetition_penalty != 1.0:
            f |= F_REPETITION
        if self.presence_penalty or self.frequency_penalty:
            f |= F_PRESENCE
        if self.no_repeat_ngram_size:
            f |= F_NGRAM
        if self.bad_words_ids or self.suppress_tokens or self.begin_suppress_tokens:
            f |= F_BAN
        if self.min_tokens or self.forced_eos_token_id:
            f |= F_BAN
        if self.logits_processors:
            f |= F_USER
        if not self.greedy:
            f |= F_WARP
        if self.renormalize_logits:
            f |= F_RENORM
        if self.output_scores or self.output_logits or self.logprobs is not None:
            f |= F_RECORD
        if self.n > 1:
            f |= F_FORK
        if self.beam_search:
            f |= F_BEAM
        if self.structured is not None:
            f |= F_STRUCTURED
        return f

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
