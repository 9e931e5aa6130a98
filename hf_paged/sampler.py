"""Token selection for one step's batch of logits rows: greedy, temperature, top-k, top-p, seeds.

The warpers follow transformers' definitions exactly (temperature, then top-k keeping ties with the
k-th value, then top-p dropping the low tail whose cumulative probability is <= 1 - p), so sampling
here draws from the same distribution as transformers' generate. A draw is argmax(probs / E) with
E ~ Exponential(1) per vocabulary entry (an exact categorical sample); seeded requests draw E from
their own generator, so their tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from hf_paged.request import Request


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """top_k: int [B], 0 = off. Keeps every logit >= the k-th largest (ties included)."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_p: float [B], 1.0 = off. Same rule as transformers' TopPLogitsWarper."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum_probs <= (1 - top_p).unsqueeze(-1)
    remove[:, -1] = False  # always keep the most likely token
    remove = remove.scatter(-1, sorted_idx, remove)
    return logits.masked_fill(remove, float("-inf"))


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits: float [B, V] for the B requests that sample this step -> token ids int64 [B]."""
        params = [r.sampling_params for r in requests]
        greedy = [p.greedy for p in params]
        argmax = logits.argmax(dim=-1)
        if all(greedy):
            return argmax
        logits = logits.float()
        temps = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, params)], device=logits.device
        )
        logits = logits / temps.unsqueeze(-1)
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=logits.device)
            logits = apply_top_k(logits, top_k)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            logits = apply_top_p(logits, top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_()  # unseeded rows: the global generator
        for row, request in enumerate(requests):
            if request.generator is not None and not greedy[row]:
                noise[row].exponential_(generator=request.generator)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=logits.device), argmax, sampled)
        return sampled
