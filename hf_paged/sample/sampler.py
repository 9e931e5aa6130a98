"""Token selection for one step's batch of logits rows.

Raw logits -> hf_paged.sample.logits_processing (transformers' processors and warpers, per-row
parameters) -> argmax for greedy rows, a categorical draw for sampling rows. A draw is
argmax(probs / E) with E ~ Exponential(1) per vocabulary entry (an exact categorical sample);
seeded requests draw E from their own generator, so their tokens do not depend on which other
requests share the batch.

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
from hf_paged.sampling_params import F_BEAM, F_FORK, F_RECORD, F_STRUCTURED, F_WARP
from hf_paged.structured_output.logits_mask import GrammarBitmask, GrammarMask
from hf_paged.worker.host_to_device import device_tensor


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
    ) -> SamplerOutput:
        """logits: float [B, V] for the B rows that sample this step; pool: the penalty counts
        (rows with a penalty need it); grammar: the constrained rows' bitmask when the runner
        prepared it ahead (while the forward ran), else it is prepared here."""
        feats = [r.features for r in rows]
        any_feats = 0
        for f in feats:
            any_feats |= f
        if not any_feats:  # all greedy, nothing to process or record: the hot path
            return SamplerOutput(argmax(logits))
        out = SamplerOutput(None)
        if any_feats & F_BEAM:
            out.tokens = self._defer_beams(logits, rows, feats, pool, out)
        else:
            out.tokens = self._sample(logits, rows, feats, any_feats, pool, out, grammar)
        return out

    def _sample(self, logits, rows, feats, any_feats, pool, out, grammar) -> torch.Tensor:
        logits = logits.float()
        num_rows = len(rows)
        if any_feats & F_FORK:
            logits, rows, feats = _add_fork_rows(logits, rows, feats)
        failed: dict[str, BaseException] = {}
        if any_feats & F_STRUCTURED:  # grammar masks first: every later stage sees them
            if grammar is None or grammar.num_rows != len(rows):  # (forked siblings' rows)
                grammar = self.grammar.prepare(rows, logits.shape[-1])
            failed.update(grammar.failed)
            self.grammar.apply(logits, grammar)
        scores = process_logits(logits, rows, feats, any_feats, pool, failed)
        if pool is not None:  # forked siblings' rows are one-off: they get a row of their own
            for sibling in rows[num_rows:]:
                pool.release(sibling.req_id)
        out.failed = failed or None
        tokens = argmax(scores)
        if any_feats & F_WARP:
            warped = [i for i, f in enumerate(feats) if f & F_WARP]
            tokens = _draw(scores, rows, warped, tokens)
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
        logp = logits.index_select(0, at).log_softmax(dim=-1)
        chosen_tokens = tokens.index_select(0, at)
        top_n = max(kept_rows[k].params.logprobs for k in chosen)
        top = logp.topk(min(top_n, logp.shape[-1]), dim=-1) if top_n else None
        own = logp.gather(-1, chosen_tokens[:, None])[:, 0].tolist()
        chosen_tokens = chosen_tokens.tolist()
        top_vals = top.values.tolist() if top is not None else None
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
