"""Token selection for one step's batch of logits rows.

Raw logits -> hf_paged.sample.logits_processing (penalties, bans, user processors, per-row
parameters) -> argmax for greedy rows, a categorical draw for sampling rows.

Sampling rows take kernels/sampling.py: temperature, top-k, top-p and min-p cut by a threshold
search over the row (no sort of the vocabulary), then one draw by inverse CDF with one uniform
per row; a seeded request draws its uniform from its own generator, so its tokens do not depend
on which other requests share the batch, and unseeded rows draw from torch's global generator.
On CPU the same rule runs in torch (sample_rows_ref). Rows with typical-p or output_scores
(which return transformers' processed scores row) take the full warpers of logits_processing
and a draw argmax(probs / E), E ~ Exponential(1) per entry.

The sampler keeps nothing between calls: it reads the step's SamplingRows (sample/metadata.py,
owned by the runner's input batch) and returns a SamplerOutput: the tokens, and what requests
asked to keep: the processed scores row (transformers' `scores`), the raw logits row (`logits`),
vLLM-style logprobs (the raw model distribution: the chosen token plus the top-n), the first
tokens of n > 1 siblings, beam rows' logits, and what a user logits processor raised.

An all-greedy decode batch replayed from a CUDA graph does not come here: the graph took the
same argmax inside itself (the runner checks for no feature bits, this hot path's condition).
"""

from __future__ import annotations

import torch

from hf_paged.sample.logits_processing import TokenCountPool, process_logits
from hf_paged.sample.metadata import SamplerOutput, SamplingRow
from hf_paged.sampling_params import F_BEAM, F_FORK, F_RECORD, F_RENORM, F_STRUCTURED, F_WARP
from hf_paged.structured_output.logits_mask import GrammarBitmask, GrammarMask
from hf_paged.worker.host_to_device import device_rows, device_tensor


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for [rows, vocab] scores. On a GPU, kernels/argmax.py: the same index
    (first maximum, NaN as the maximum) in one pass a row; torch's reduction took 11-12 us for
    one 32,000-entry row on the H200, about 1.5% of a batch-1 step."""
    if x.is_cuda:
        # imported here, as elsewhere in hf_paged: Triton decides compile-or-interpret when the
        # kernels are decorated, which must not happen at `import hf_paged`
        from hf_paged.kernels import argmax_rows

        return argmax_rows(x)
    return x.argmax(dim=-1)


class Sampler:
    """Stateless: sample(logits, rows, pool) -> SamplerOutput. (It owns one reusable buffer:
    the host side of structured output's token bitmask.)"""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.grammar = GrammarBitmask(device)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        pool: TokenCountPool | None = None,
        grammar: GrammarMask | None = None,
        features: int | None = None,
    ) -> SamplerOutput:
        """logits: float [B, V] for the B rows that sample this step; pool: the penalty counts
        (rows with a penalty need it); grammar: the constrained rows' bitmask when the runner
        prepared it ahead (while the forward ran), else it is prepared here; features: every
        feature bit of the rows, when the caller has it (the runner, from its arrays)."""
        any_feats = features
        if any_feats is None:
            any_feats = 0
            for r in rows:
                any_feats |= r.features
        if not any_feats:  # all greedy, nothing to process or record: the hot path
            return SamplerOutput(argmax(logits))
        if any_feats == F_STRUCTURED:  # all greedy, some rows grammar-constrained
            if grammar is None or grammar.num_rows != len(rows):
                grammar = self.grammar.prepare(rows, logits.shape[-1])
            tokens = self.grammar.argmax(logits, grammar)
            return SamplerOutput(tokens, failed=grammar.failed or None)
        out = SamplerOutput(None)
        feats = [r.features for r in rows]
        if any_feats & F_BEAM:
            out.tokens = self._defer_beams(logits, rows, feats, pool, out)
        else:
            out.tokens = self._sample(logits, rows, feats, any_feats, pool, out, grammar)
        return out

    def _sample(self, logits, rows, feats, any_feats, pool, out, grammar) -> torch.Tensor:
        if any_feats & ~(F_WARP | F_FORK) or any(not _kernel_ok(r) for r in rows if r.features):
            logits = logits.float()  # the processors work in float32; the kernel reads any
        num_rows = len(rows)
        if any_feats & F_FORK:
            logits, rows, feats = _add_fork_rows(logits, rows, feats)
        failed: dict[str, BaseException] = {}
        if any_feats & F_STRUCTURED:  # grammar masks first: every later stage sees them
            if grammar is None or grammar.num_rows != len(rows):  # (forked siblings' rows)
                grammar = self.grammar.prepare(rows, logits.shape[-1])
            failed.update(grammar.failed)
            self.grammar.apply(logits, grammar)
        # rows the kernel samples leave their warpers (and the renormalisation, which only
        # shows in recorded scores, which these rows do not keep) to it
        fast = [i for i, (r, f) in enumerate(zip(rows, feats)) if f & F_WARP and _kernel_ok(r)]
        proc_feats = list(feats)
        for i in fast:
            proc_feats[i] &= ~(F_WARP | F_RENORM)
        proc_any = 0
        for f in proc_feats:
            proc_any |= f
        scores = process_logits(logits, rows, proc_feats, proc_any, pool, failed)
        if pool is not None:  # forked siblings' rows are one-off: they get a row of their own
            for sibling in rows[num_rows:]:
                pool.release(sibling.req_id)
        out.failed = failed or None
        if len(fast) == len(rows):  # every row samples in the kernel: no argmax needed
            tokens = draw_fast(scores, rows, fast, None)
        else:
            tokens = argmax(scores)
            if any_feats & F_WARP:
                warped = [i for i, f in enumerate(proc_feats) if f & F_WARP]
                if warped:
                    tokens = _draw(scores, rows, warped, tokens)
                if fast:
                    tokens = draw_fast(scores, rows, fast, tokens)
        if any_feats & F_RECORD:
            record(logits, scores, tokens, rows, feats, out)
        if len(rows) > num_rows:  # first tokens of forked siblings
            extra = tokens[num_rows:].tolist()
            out.fork_tokens = {r.req_id: t for r, t in zip(rows[num_rows:], extra)}
            tokens = tokens[:num_rows]
        return tokens

    def _defer_beams(self, logits, rows, feats, pool, out: SamplerOutput) -> torch.Tensor:
        """Beam rows hand their raw logits row to hf_paged.generation.beam_search (token -1
        here); the other rows are sampled as usual."""
        tokens = torch.full((len(rows),), -1, dtype=torch.long, device=logits.device)
        rest = [i for i, f in enumerate(feats) if not f & F_BEAM]
        out.beam_logits = {
            rows[i].req_id: logits[i].float() for i, f in enumerate(feats) if f & F_BEAM
        }
        if rest:
            idx = torch.tensor(rest, device=logits.device)
            sub = self(logits.index_select(0, idx), [rows[i] for i in rest], pool)
            tokens.index_copy_(0, idx, sub.tokens)
            out.fork_tokens, out.failed = sub.fork_tokens, sub.failed
            out.logprobs, out.scores, out.logits = sub.logprobs, sub.scores, sub.logits
        return tokens


def _add_fork_rows(logits, rows, feats):
    """A row whose prompt just finished and that has pending siblings: each sibling gets a row
    with the same logits (the prompt is computed once for all n samples)."""
    parents = [k for k, r in enumerate(rows) if r.siblings and r.num_output_tokens == 0]
    if not parents:
        return logits, rows, feats
    src, extra = [], []
    for k in parents:
        for sibling in rows[k].siblings:
            src.append(k)
            extra.append(sibling)
    logits = torch.cat([logits, logits[torch.tensor(src, device=logits.device)]])
    return logits, list(rows) + extra, feats + [r.features for r in extra]


def _kernel_ok(row: SamplingRow) -> bool:
    """A sampling row the kernel can take: typical-p needs its sort, and output_scores rows
    return the processed scores row, which only the full warpers build."""
    p = row.params
    return p.typical_p == 1.0 and not p.output_scores


def draw_fast(
    scores: torch.Tensor, rows: list[SamplingRow], sel: list[int], tokens: torch.Tensor | None
) -> torch.Tensor:
    """Sample rows `sel` of scores (raw or processed logits, warpers not applied) with
    kernels/sampling_topk.py (rows with a small top_k) and kernels/sampling.py (the others);
    into tokens (None: sel is every row, in order)."""
    dev = scores.device
    ps = [rows[i].params for i in sel]
    top_ks = [p.top_k for p in ps]
    # one host-to-device copy for the four parameter rows (top_k exact in float32)
    params = device_rows(
        [[p.temperature for p in ps], top_ks, [p.top_p for p in ps], [p.min_p for p in ps]], dev
    )
    u = torch.rand(len(sel), device=dev)  # unseeded rows: the global generator
    seeded = [(k, rows[i].generator) for k, i in enumerate(sel) if rows[i].generator is not None]
    if seeded:
        own = [torch.rand(1, generator=g, device=g.device).to(dev) for _, g in seeded]
        u.index_copy_(0, device_tensor([k for k, _ in seeded], dev), torch.cat(own))
    all_rows = tokens is None
    sub = scores if all_rows else scores.index_select(0, device_tensor(sel, dev))
    sampled = _draw_rows(sub, params, u, top_ks)
    return sampled if all_rows else tokens.index_copy(0, device_tensor(sel, dev), sampled)


def _draw_rows(
    x: torch.Tensor,
    params: list[torch.Tensor],
    u: torch.Tensor,
    top_ks: list[int],
    kernels: bool | None = None,
) -> torch.Tensor:
    """One token per row of x: rows whose top_k the candidate list holds take
    kernels/sampling_topk.py (torch.topk, then a draw over the row), the others
    kernels/sampling.py (threshold searches). kernels (default: x on a GPU); False: the torch
    reference, the CPU path."""
    from hf_paged.kernels.sampling import sample_rows, sample_rows_ref  # see argmax()
    from hf_paged.kernels.sampling_topk import TOPK_CAP, list_length, sample_rows_topk

    temp, top_k, top_p, min_p = params
    top_k = top_k.to(torch.int32)
    if not (x.is_cuda if kernels is None else kernels):
        return sample_rows_ref(x, temp, top_k, top_p, min_p, u)
    vocab = x.shape[1]
    short = [i for i, k in enumerate(top_ks) if 0 < k <= TOPK_CAP and list_length(k) <= vocab]
    if not short:
        return sample_rows(x, temp, top_k, top_p, min_p, u)
    k_max = max(top_ks[i] for i in short)
    if len(short) == len(top_ks):
        return sample_rows_topk(x, temp, top_k, top_p, min_p, u, k_max)
    listed = set(short)
    rest = [i for i in range(len(top_ks)) if i not in listed]
    out = torch.empty(len(top_ks), dtype=torch.long, device=x.device)
    for group, fn, extra in ((short, sample_rows_topk, (k_max,)), (rest, sample_rows, ())):
        idx = device_tensor(group, x.device)
        args = [t.index_select(0, idx) for t in (x, temp, top_k, top_p, min_p, u)]
        out.index_copy_(0, idx, fn(*args, *extra))
    return out


def _draw(scores: torch.Tensor, rows: list[SamplingRow], sel: list[int], tokens: torch.Tensor):
    dev = scores.device
    all_rows = len(sel) == scores.shape[0]
    idx = None if all_rows else device_tensor(sel, dev)
    probs = (scores if all_rows else scores.index_select(0, idx)).softmax(dim=-1)
    noise = torch.empty_like(probs)
    noise.exponential_()  # unseeded rows: the global generator
    for k, i in enumerate(sel):
        gen = rows[i].generator
        if gen is not None:
            noise[k].exponential_(generator=gen)
    sampled = argmax(probs / noise)
    return sampled if all_rows else tokens.index_copy(0, idx, sampled)


def record(
    logits: torch.Tensor,
    scores: torch.Tensor,
    tokens: torch.Tensor,
    rows: list[SamplingRow],
    feats: list[int],
    out: SamplerOutput,
) -> None:
    """What rows asked to keep, into out. Rows are copied out in one gather per kind, so a kept
    row does not pin the whole step's [B, V] tensor."""
    sel = [i for i, f in enumerate(feats) if f & F_RECORD]
    kept_rows = [rows[i] for i in sel]
    dev = logits.device
    idx = torch.tensor(sel, device=dev)
    for attr, flag, source in (
        ("scores", "output_scores", scores),
        ("logits", "output_logits", logits),
    ):
        chosen = [k for k, r in enumerate(kept_rows) if getattr(r.params, flag)]
        if not chosen:
            continue
        kept = source.index_select(0, idx[chosen]).unbind(0)
        setattr(out, attr, {kept_rows[k].req_id: row for k, row in zip(chosen, kept)})
    chosen = [k for k, r in enumerate(kept_rows) if r.params.logprobs is not None]
    if chosen:
        at = idx[chosen]
        # log_softmax(x)[t] = x[t] - logsumexp(x): the [R, V] log-probabilities are never built,
        # only the sampled token's and the top-n (top-n of x are top-n of log_softmax(x))
        raw = logits.index_select(0, at).float()
        lse = raw.logsumexp(dim=-1, keepdim=True)
        chosen_tokens = tokens.index_select(0, at)
        top_n = max(kept_rows[k].params.logprobs for k in chosen)
        top = raw.topk(min(top_n, raw.shape[-1]), dim=-1) if top_n else None
        own = (raw.gather(-1, chosen_tokens[:, None]) - lse)[:, 0].tolist()
        chosen_tokens = chosen_tokens.tolist()
        top_vals = (top.values - lse).tolist() if top is not None else None
        top_ids = top.indices.tolist() if top is not None else None
        logprobs = {}
        for j, k in enumerate(chosen):
            r = kept_rows[k]
            entry = {chosen_tokens[j]: own[j]}
            n = r.params.logprobs
            if n:
                for t, v in zip(top_ids[j][:n], top_vals[j][:n]):
                    entry.setdefault(t, v)
            logprobs[r.req_id] = entry
        out.logprobs = logprobs
