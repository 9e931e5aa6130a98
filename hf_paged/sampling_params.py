"""Per-request generation options (vLLM's SamplingParams, with transformers' meaning of each field)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and stops. Validated on construction: bad values raise ValueError.

    temperature 0 means greedy (argmax); otherwise logits / temperature, then top-k, then top-p,
    in that order, exactly as transformers' warpers apply them.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None  # per-request generator: output independent of the rest of the batch
    ignore_eos: bool = False
    # None: the engine's default end-of-sequence ids (the model's generation_config)
    eos_token_id: int | list[int] | None = None
    stop_token_ids: list[int] | None = None  # extra ids that end the request (kept in the output)
    prompt_logprobs: bool = False  # return log p(prompt[i] | prompt[:i]) for every prompt token

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        for name in ("eos_token_id", "stop_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(f"{name} must be non-negative integer token ids, got {ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
