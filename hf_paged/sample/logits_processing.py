"""transformers' logits processors, batched over one step's rows with per-row parameters.

Each stage runs only when some row of the batch uses it (SamplingParams.features), and only on
those rows, so a batch without penalties pays nothing for them. The order and the arithmetic are
transformers' (see GenerationMixin._get_logits_processor); every stage that masks writes -inf, so
masks commute with each other and with the repetition penalty (-inf * p = -inf), and only the
order of value-changing stages matters:

    repetition_penalty -> presence/frequency (vLLM) -> no_repeat_ngram -> bad words / min_tokens ->
    forced eos -> suppress / begin_suppress -> user logits_processors -> [sampling rows]
    temperature -> top-k -> top-p -> min-p -> typical-p -> renormalize (log-softmax)

State that grows with the sequence is kept incrementally, so a step costs O(rows), not O(tokens):
token counts for penalties live in one [slots, V] pool (one scatter per step for all rows), and
n-gram bans in a per-request dict extended by one n-gram per new token.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from hf_paged.sample.metadata import SamplingRow
from hf_paged.sampling_params import (
    F_BAN,
    F_NGRAM,
    F_PRESENCE,
    F_RENORM,
    F_REPETITION,
    F_USER,
    F_WARP,
)
from hf_paged.worker.host_to_device import device_tensor

NEG_INF = float("-inf")


# -- warpers (sampling rows): per-row parameter tensors, transformers' definitions -----------------


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """top_k: int [B], 0 = off. Keeps every logit >= the k-th largest (ties included)."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_p: float [B]. Same rule as transformers' TopPLogitsWarper (call it on rows with p < 1:
    with p = 1 the rule still drops tokens whose probability underflows to 0)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum_probs <= (1 - top_p).unsqueeze(-1)
    remove[:, -1] = False  # always keep the most likely token
    remove = remove.scatter(-1, sorted_idx, remove)
    return logits.masked_fill(remove, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """min_p: float [B], 0 = off. Drops tokens whose probability is below min_p * the top one."""
    probs = logits.softmax(dim=-1)
    remove = probs < min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)  # keep at least one
    return logits.masked_fill(remove, NEG_INF)


def apply_typical_p(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """mass: float [B] in (0, 1). Transformers' TypicalLogitsWarper, row by row parameters."""
    logp = logits.log_softmax(dim=-1)
    entropy = -(logp * logp.exp()).nansum(-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    sorted_shifted, sorted_idx = shifted.sort(dim=-1)
    cum_probs = logits.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cum_probs < mass.unsqueeze(-1)).sum(dim=-1).clamp(max=logits.shape[-1] - 1)
    remove = sorted_shifted > sorted_shifted.gather(-1, last.unsqueeze(-1))
    remove[:, 0] = False
    remove = remove.scatter(-1, sorted_idx, remove)
    return logits.masked_fill(remove, NEG_INF)


def _subset(scores: torch.Tensor, rows: list[int], fn, *values: list) -> torch.Tensor:
    """Apply fn(sub_scores, *param_tensors) to the listed rows only (all rows: no gather)."""
    dev = scores.device
    # through pinned memory: a pageable copy would make the host wait for the GPU (async steps)
    tensors = [device_tensor(v, dev) for v in values]
    if len(rows) == scores.shape[0]:
        return fn(scores, *tensors)
    idx = device_tensor(rows, dev)
    return scores.index_copy(0, idx, fn(scores.index_select(0, idx), *tensors))


def apply_warpers(
    scores: torch.Tensor, requests: list[SamplingRow], rows: list[int]
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, typical-p on the sampling rows, in transformers' order."""
    ps = [requests[i].params for i in rows]
    temps = [p.temperature for p in ps]
    if any(t != 1.0 for t in temps):
        scores = _subset(scores, rows, lambda s, t: s / t.unsqueeze(-1), temps)
    for attr, off, fn in (
        ("top_k", 0, apply_top_k),
        ("top_p", 1.0, apply_top_p),
        ("min_p", 0.0, apply_min_p),
        ("typical_p", 1.0, apply_typical_p),
    ):
        sel = [(i, getattr(p, attr)) for i, p in zip(rows, ps) if getattr(p, attr) != off]
        if sel:
            scores = _subset(scores, [i for i, _ in sel], fn, [v for _, v in sel])
    return scores


# -- penalties -------------------------------------------------------------------------------------


class TokenCountPool:
    """Per-request token statistics for penalties, one row per request that uses them:
    prompt_mask[slot, v] (v occurs in the prompt) and output_counts[slot, v] (times v was
    generated). A row is claimed on a request's first penalised step and released when the
    request leaves the running set (the runner's InputBatch.release: finished, aborted, failed,
    preempted, rewritten); a SamplingRow built anew for the same request claims a fresh row."""

    def __init__(self, device: torch.device, vocab_size: int = 0) -> None:
        self.device = device
        self._size(vocab_size)
        self.owners: list[SamplingRow | None] = []
        self.slot_of: dict[str, int] = {}  # request id -> its row

    def _size(self, vocab_size: int) -> None:
        """The vocabulary is the logits' width (lm_head rows, which may pad the tokenizer's):
        known at the first penalised step."""
        self.vocab_size = vocab_size
        self.prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=self.device)

    def release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.owners[slot] = None

    def _claim(self, request: SamplingRow) -> int:
        self.release(request.req_id)
        for slot, owner in enumerate(self.owners):
            if owner is None:
                break
        else:
            slot = len(self.owners)
            grow = max(8, slot)
            self.owners.extend([None] * grow)
            v = self.vocab_size
            self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(grow, v)])
            self.output_counts = torch.cat(
                [self.output_counts, self.output_counts.new_zeros(grow, v)]
            )
        self.owners[slot] = request
        self.slot_of[request.req_id] = slot
        request.penalty_slot = slot
        request.penalty_num_counted = 0
        self.prompt_mask[slot] = False
        self.output_counts[slot] = 0
        prompt = torch.tensor(request.prompt_token_ids, device=self.device)
        self.prompt_mask[slot, prompt.clamp(max=self.vocab_size - 1)] = True
        return slot

    def sync(self, requests: list[SamplingRow], vocab_size: int) -> torch.Tensor:
        """Bring the rows of these requests up to date; returns their slots (int64 [R])."""
        if vocab_size != self.vocab_size:
            if self.slot_of:
                raise RuntimeError("penalty counts: the vocabulary size changed")
            self._size(vocab_size)
            self.owners = []
        slots, new_slots, new_tokens = [], [], []
        for r in requests:
            slot = r.penalty_slot
            if slot < 0 or slot >= len(self.owners) or self.owners[slot] is not r:
                slot = self._claim(r)
            start = r.num_prompt_tokens + r.penalty_num_counted
            fresh = r.token_ids[start:]  # usually the one token sampled last step
            if fresh:
                new_slots.extend([slot] * len(fresh))
                new_tokens.extend(fresh)
                r.penalty_num_counted += len(fresh)
            slots.append(slot)
        if new_tokens:
            idx = (
                torch.tensor(new_slots, device=self.device),
                torch.tensor(new_tokens, device=self.device).clamp(max=self.vocab_size - 1),
            )
            ones = torch.ones(len(new_tokens), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(idx, ones, accumulate=True)
        return torch.tensor(slots, device=self.device)


def _apply_penalties(
    scores: torch.Tensor, requests: list[SamplingRow], rows: list[int], pool: TokenCountPool
) -> torch.Tensor:
    dev = scores.device
    reqs = [requests[i] for i in rows]
    slots = pool.sync(reqs, scores.shape[-1])
    counts = pool.output_counts.index_select(0, slots)
    idx = torch.tensor(rows, device=dev)
    sub = scores.index_select(0, idx)
    ps = [r.params for r in reqs]
    rep = [p.repetition_penalty for p in ps]
    if any(x != 1.0 for x in rep):
        # transformers: every token of the prompt and output, score<0 ? score*p : score/p
        seen = pool.prompt_mask.index_select(0, slots) | (counts > 0)
        penalty = torch.tensor(rep, device=dev).unsqueeze(-1)
        penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
        sub = torch.where(seen, penalised, sub)
    pres = [p.presence_penalty for p in ps]
    freq = [p.frequency_penalty for p in ps]
    if any(pres) or any(freq):
        # vLLM: output tokens only, subtracted from the logits
        c = counts.to(sub.dtype)
        sub = sub - torch.tensor(freq, device=dev).unsqueeze(-1) * c
        sub = sub - torch.tensor(pres, device=dev).unsqueeze(-1) * (c > 0).to(sub.dtype)
    return scores.index_copy(0, idx, sub)


# -- masks -----------------------------------------------------------------------------------------


def _ngram_bans(r: SamplingRow) -> list[int]:
    """Tokens that would repeat an n-gram of the request's tokens (prompt included, as in
    transformers for decoder-only models). The index grows by the n-grams the last step added."""
    n = r.params.no_repeat_ngram_size
    tokens = r.token_ids
    if r.ngram_index is None:
        r.ngram_index, r.ngram_num_indexed = {}, 0
    index = r.ngram_index
    for start in range(r.ngram_num_indexed, len(tokens) - n + 1):
        index.setdefault(tuple(tokens[start : start + n - 1]), []).append(tokens[start + n - 1])
    r.ngram_num_indexed = max(r.ngram_num_indexed, len(tokens) - n + 1)
    if len(tokens) < n:
        return []
    return index.get(tuple(tokens[len(tokens) - n + 1 :]), [])


def _collect_bans(
    requests: list[SamplingRow], feats: list[int], rows_out, toks_out, mask_rows
) -> None:
    for i, (r, f) in enumerate(zip(requests, feats)):
        if f & F_NGRAM:
            bans = _ngram_bans(r)
            rows_out.extend([i] * len(bans))
            toks_out.extend(bans)
        if not f & F_BAN:
            continue
        p = r.params
        if r.banned_token_ids:
            mask_rows.append(i)
        tokens = r.token_ids
        for prefix, last in r.bad_word_prefixes:
            k = len(prefix)
            if k <= len(tokens) and tuple(tokens[len(tokens) - k :]) == prefix:
                rows_out.append(i)
                toks_out.append(last)
        num_out = r.num_output_tokens
        if num_out < p.min_tokens and r.stop_token_ids:
            rows_out.extend([i] * len(r.stop_token_ids))
            toks_out.extend(r.stop_token_ids)
        if num_out == 0 and p.begin_suppress_tokens:
            rows_out.extend([i] * len(p.begin_suppress_tokens))
            toks_out.extend(p.begin_suppress_tokens)


def _apply_bans(
    scores: torch.Tensor, requests: list[SamplingRow], feats: list[int]
) -> torch.Tensor:
    rows, toks, mask_rows = [], [], []
    _collect_bans(requests, feats, rows, toks, mask_rows)
    dev, vocab = scores.device, scores.shape[-1]
    if mask_rows:
        masks = []
        for i in mask_rows:
            r = requests[i]
            if r.ban_mask is None or r.ban_mask.device != dev:
                m = torch.zeros(vocab, dtype=torch.bool, device=dev)
                ids = [t for t in r.banned_token_ids if t < vocab]
                m[torch.tensor(ids, dtype=torch.long, device=dev)] = True
                r.ban_mask = m
            masks.append(r.ban_mask)
        idx = torch.tensor(mask_rows, device=dev)
        sub = scores.index_select(0, idx).masked_fill(torch.stack(masks), NEG_INF)
        scores = scores.index_copy(0, idx, sub)
    if rows:
        keep = [(i, t) for i, t in zip(rows, toks) if t < vocab]
        scores = scores.index_put(
            (
                torch.tensor([i for i, _ in keep], dtype=torch.long, device=dev),
                torch.tensor([t for _, t in keep], dtype=torch.long, device=dev),
            ),
            torch.tensor(NEG_INF, dtype=scores.dtype, device=dev),
        )
    return _force_eos(scores, requests, feats)


def _force_eos(scores: torch.Tensor, requests: list[SamplingRow], feats: list[int]) -> torch.Tensor:
    """transformers' ForcedEOSTokenLogitsProcessor on the rows about to make their last token:
    every score -inf, the forced ids 0. It runs after the bad-word and min-length bans (it
    overrides them) and before suppress_tokens / begin_suppress_tokens (they still mask a forced
    id), so those masks are put back on the forced ids here."""
    cloned = False
    for i, (r, f) in enumerate(zip(requests, feats)):
        p = r.params
        if not (f & F_BAN and p.forced_eos_token_id):
            continue
        if r.num_output_tokens != p.max_tokens - 1:
            continue
        masked = set(p.suppress_tokens or ())
        if r.num_output_tokens == 0:
            masked |= set(p.begin_suppress_tokens or ())
        ids = [t for t in p.forced_eos_token_id if t not in masked]
        if not cloned:  # the caller's logits are never written
            scores, cloned = scores.clone(), True
        scores[i] = NEG_INF
        scores[i, ids] = 0.0
    return scores


# -- user processors -------------------------------------------------------------------------------


def _apply_user(
    scores: torch.Tensor, requests: list[SamplingRow], rows: list[int], failed: dict | None
) -> torch.Tensor:
    """transformers semantics, one request at a time: processor(input_ids [1, L], scores [1, V]).
    Costs one Python call per processor per request per step, plus building input_ids (O(L)).
    A processor that raises fails its own request only: the exception goes into `failed` (by
    request id; the row's scores are left as they were and its token is void), or, without
    `failed`, up to the caller."""
    scores = scores.clone()
    for i in rows:
        r = requests[i]
        ids = torch.tensor([r.token_ids], dtype=torch.long, device=scores.device)
        procs = LogitsProcessorList(r.params.logits_processors)
        try:
            scores[i : i + 1] = procs(ids, scores[i : i + 1])
        except Exception as exc:
            if failed is None:
                raise
            failed[r.req_id] = exc
    return scores


# -- the pipeline ----------------------------------------------------------------------------------


def process_logits(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    feats: list[int],
    any_feats: int,
    pool: TokenCountPool | None,
    failed: dict | None = None,
) -> torch.Tensor:
    """Turn one step's raw logits rows into transformers' `scores` rows. logits: float32 [B, V]
    (not modified). Returns scores [B, V] (logits itself when no row uses any stage). pool: the
    penalty counts (needed when a row has a penalty). failed: see _apply_user."""
    scores = logits
    if any_feats & (F_REPETITION | F_PRESENCE):
        sel = [i for i, f in enumerate(feats) if f & (F_REPETITION | F_PRESENCE)]
        scores = _apply_penalties(scores, rows, sel, pool)
    if any_feats & (F_NGRAM | F_BAN):
        scores = _apply_bans(scores, rows, feats)
    if any_feats & F_USER:
        sel = [i for i, f in enumerate(feats) if f & F_USER]
        scores = _apply_user(scores, rows, sel, failed)
    if any_feats & F_WARP:
        scores = apply_warpers(scores, rows, [i for i, f in enumerate(feats) if f & F_WARP])
    if any_feats & F_RENORM:
        sel = [i for i, f in enumerate(feats) if f & F_RENORM]
        scores = _subset(scores, sel, lambda s: s.log_softmax(dim=-1))
    return scores
