"""Verification of proposed tokens: the target's logits at each proposal decide how many it keeps.

A request that proposed d_1..d_k computed, in one forward, the target's logits at its last known
token and at each proposal: k + 1 rows, row j giving the target's distribution p_j for the token
after d_1..d_j. Proposals are kept from the left while the target accepts them; the first
rejection (or the end of the run) adds one token of the target's own, so a verify step gives
between 1 and k + 1 tokens.

- Greedy rows accept d_j while it is the argmax of p_{j-1}'s raw logits, then add that argmax:
  token for token what decoding one token at a time gives.
- Sampled rows use speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept d_j
  with probability min(1, p(d_j) / q(d_j)); at the first rejection draw from
  norm(max(0, p - q)); after k acceptances draw the extra token from p_k. The proposers here are
  deterministic (prompt lookup, a draft model's greedy token), so q is one-hot on d_j: accept
  with probability p(d_j), on rejection draw from p with d_j removed. Each emitted token is then
  distributed exactly as p. p is the target's scores after the request's own processing
  (temperature, top-k/p, min-p, typical-p), so proposals are judged by the distribution the
  request samples from.

Requests whose sampling reads the token history (penalties, bans, user processors, min_tokens)
or that record logprobs/scores are never given proposals (spec_decode.proposer.eligible).
"""

from __future__ import annotations

import torch

from hf_paged.sample.logits_processing import process_logits
from hf_paged.sample.metadata import SamplingRow
from hf_paged.sample.sampler import argmax
from hf_paged.sampling_params import F_WARP


def verify(
    logits: torch.Tensor, rows: list[SamplingRow], proposals: list[list[int]]
) -> list[list[int]]:
    """logits: [sum(len(p) + 1 for p in proposals), V], the rows of each request in order;
    rows[i] / proposals[i]: the i-th request. Returns each request's tokens for this step: its
    accepted proposals, then the target's token."""
    counts = [len(p) + 1 for p in proposals]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    out: list[list[int] | None] = [None] * len(rows)
    greedy = [i for i, r in enumerate(rows) if not r.features & F_WARP]
    sampled = [i for i, r in enumerate(rows) if r.features & F_WARP]
    if greedy:
        _verify_greedy(logits, greedy, offsets, proposals, out)
    if sampled:
        _verify_sampled(logits, rows, sampled, offsets, proposals, out)
    return out


def _verify_greedy(logits, sel, offsets, proposals, out) -> None:
    if len(sel) == len(proposals):
        targets = argmax(logits).tolist()
    else:
        idx = [j for i in sel for j in range(offsets[i], offsets[i + 1])]
        picked = argmax(logits[torch.tensor(idx, device=logits.device)]).tolist()
        targets = [0] * logits.shape[0]
        for j, t in zip(idx, picked):
            targets[j] = t
    for i in sel:
        row = targets[offsets[i] : offsets[i + 1]]
        tokens = []
        for d, t in zip(proposals[i], row):
            if d != t:
                break
            tokens.append(d)
        tokens.append(row[len(tokens)])
        out[i] = tokens


def _verify_sampled(logits, rows, sel, offsets, proposals, out) -> None:
    dev = logits.device
    idx = [j for i in sel for j in range(offsets[i], offsets[i + 1])]
    expanded = [rows[i] for i in sel for _ in range(offsets[i + 1] - offsets[i])]
    feats = [r.features for r in expanded]
    any_feats = 0
    for f in feats:
        any_feats |= f
    sub = logits.index_select(0, torch.tensor(idx, device=dev)).float()
    probs = process_logits(sub, expanded, feats, any_feats, None).softmax(dim=-1)
    # p_j(d_{j+1}) at every proposal position, and one uniform draw each
    local, draft_pos, draft_tok = 0, [], []
    starts = []
    for i in sel:
        starts.append(local)
        for j, d in enumerate(proposals[i]):
            draft_pos.append(local + j)
            draft_tok.append(d)
        local += offsets[i + 1] - offsets[i]
    accept_p = []
    if draft_pos:
        pos_t = torch.tensor(draft_pos, device=dev)
        tok_t = torch.tensor(draft_tok, device=dev)
        accept_p = probs[pos_t, tok_t].tolist()
    uniforms = _uniforms(rows, sel, proposals, dev)
    # the row each request draws its own token from, and the proposal it rejected there (-1: none)
    draw_rows, removed, kept = [], [], []
    k0 = 0
    for n, i in enumerate(sel):
        k = len(proposals[i])
        n_acc = 0
        while n_acc < k and uniforms[k0 + n_acc] < accept_p[k0 + n_acc]:
            n_acc += 1
        k0 += k
        kept.append(proposals[i][:n_acc])
        draw_rows.append(starts[n] + n_acc)
        removed.append(proposals[i][n_acc] if n_acc < k else -1)
    dist = probs.index_select(0, torch.tensor(draw_rows, device=dev))
    rejected = [m for m, d in enumerate(removed) if d >= 0]
    if rejected:  # norm(max(0, p - onehot(d))): p without the rejected token
        r_t = torch.tensor(rejected, device=dev)
        d_t = torch.tensor([removed[m] for m in rejected], device=dev)
        dist[r_t, d_t] = 0.0
    tokens = _categorical(dist, [rows[i].generator for i in sel]).tolist()
    for n, i in enumerate(sel):
        out[i] = kept[n] + [tokens[n]]


def _uniforms(rows, sel, proposals, dev) -> list[float]:
    """One U(0, 1) per proposal; a seeded request draws from its own generator."""
    total = sum(len(proposals[i]) for i in sel)
    if not total:
        return []
    u = torch.rand(total, device=dev)
    k0 = 0
    for i in sel:
        k = len(proposals[i])
        gen = rows[i].generator
        if gen is not None and k:
            u[k0 : k0 + k] = torch.rand(k, device=gen.device, generator=gen).to(dev)
        k0 += k
    return u.tolist()


def _categorical(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One draw per row of unnormalised probabilities: argmax(probs / E), E ~ Exponential(1)
    (the sampler's draw, with the same per-request generators)."""
    noise = torch.empty_like(probs)
    noise.exponential_()
    for k, gen in enumerate(generators):
        if gen is not None:
            noise[k].exponential_(generator=gen)
    return argmax(probs / noise)
