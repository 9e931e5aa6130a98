"""Token selection for one step's batch of logits rows.

Raw logits -> hf_paged.sample.logits_processing (transformers' processors and warpers, per-row
parameters) -> argmax for greedy rows, a categorical draw for sampling rows. A draw is
argmax(probs / E) with E ~ Exponential(1) per vocabulary entry (an exact categorical sample);
seeded requests draw E from their own generator, so their tokens do not depend on which other
requests share the batch.

What a request asked to keep is recorded on it here: the processed scores row (transformers'
`scores`), the raw logits row (`logits`), and vLLM-style logprobs (the raw model distribution:
the chosen token plus the top-n).

An all-greedy decode batch replayed from a CUDA graph does not come here: the graph took the
same argmax inside itself (the runner checks for no feature bits, this hot path's condition).
"""

from __future__ import annotations

import torch

from hf_paged.core.request import Request
from hf_paged.sample.logits_processing import (  # noqa: F401  (apply_top_* re-exported for callers)
    LogitsProcessor,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
)
from hf_paged.sampling_params import F_BEAM, F_FORK, F_RECORD, F_WARP
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
    def __init__(self, device: torch.device, vocab_size: int | None = None) -> None:
        self.device = device
        self._processor: LogitsProcessor | None = None
        self._vocab_size = vocab_size
        self.fork_tokens: dict[str, list[int]] = {}
        # request id -> what its logits processor raised this step (taken with the fork tokens)
        self.failed: dict[str, BaseException] = {}

    def processor(self, vocab_size: int) -> LogitsProcessor:
        if self._processor is None:
            self._processor = LogitsProcessor(self._vocab_size or vocab_size, self.device)
        return self._processor

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits: float [B, V] for the B requests that sample this step -> token ids int64 [B]."""
        feats = [r.sampling_params.features for r in requests]
        any_feats = 0
        for f in feats:
            any_feats |= f
        if not any_feats:  # all greedy, nothing to process or record: the hot path
            return argmax(logits)
        if any_feats & F_BEAM:
            return self._defer_beams(logits, requests, feats)
        logits = logits.float()
        num_rows = len(requests)
        if any_feats & F_FORK:
            logits, requests, feats = self._add_fork_rows(logits, requests, feats)
        scores = self.processor(logits.shape[-1])(logits, requests, feats, any_feats, self.failed)
        tokens = argmax(scores)
        if any_feats & F_WARP:
            rows = [i for i, f in enumerate(feats) if f & F_WARP]
            tokens = self._draw(scores, requests, rows, tokens)
        if any_feats & F_RECORD:
            record(logits, scores, tokens, requests, feats)
        if len(requests) > num_rows:  # first tokens of forked siblings
            extra = tokens[num_rows:].tolist()
            for r, t in zip(requests[num_rows:], extra):
                self.fork_tokens.setdefault(r.parent_request_id, []).append(t)
            tokens = tokens[:num_rows]
        return tokens

    def _defer_beams(self, logits, requests, feats) -> torch.Tensor:
        """Beam rows keep their raw logits row for hf_paged.generation.beam_search (token -1
        here); the other rows are sampled as usual."""
        tokens = torch.full((len(requests),), -1, dtype=torch.long, device=logits.device)
        rest = [i for i, f in enumerate(feats) if not f & F_BEAM]
        for i, f in enumerate(feats):
            if f & F_BEAM:
                requests[i].beam_logits = logits[i].float()
        if rest:
            idx = torch.tensor(rest, device=logits.device)
            sampled = self(logits.index_select(0, idx), [requests[i] for i in rest])
            tokens.index_copy_(0, idx, sampled)
        return tokens

    def take_fork_tokens(self) -> dict[str, list[int]] | None:
        out, self.fork_tokens = self.fork_tokens, {}
        return out or None

    def take_failures(self) -> dict[str, BaseException] | None:
        out, self.failed = self.failed, {}
        return out or None

    def release(self, request_id: str) -> None:
        """The request left the running set: give back its penalty row."""
        if self._processor is not None:
            self._processor.pool.release(request_id)

    @staticmethod
    def _add_fork_rows(logits, requests, feats):
        """A request whose prompt just finished and that has pending siblings: each sibling gets
        a row with the same logits (the prompt is computed once for all n samples)."""
        parents = [
            k for k, r in enumerate(requests) if r.pending_siblings and r.num_output_tokens == 0
        ]
        if not parents:
            return logits, requests, feats
        src, extra = [], []
        for k in parents:
            for sibling in requests[k].pending_siblings:
                src.append(k)
                extra.append(sibling)
        logits = torch.cat([logits, logits[torch.tensor(src, device=logits.device)]])
        requests = list(requests) + extra
        feats = feats + [r.sampling_params.features for r in extra]
        return logits, requests, feats

    @staticmethod
    def _draw(scores: torch.Tensor, requests: list[Request], rows: list[int], tokens: torch.Tensor):
        dev = scores.device
        all_rows = len(rows) == scores.shape[0]
        idx = None if all_rows else device_tensor(rows, dev)
        probs = (scores if all_rows else scores.index_select(0, idx)).softmax(dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_()  # unseeded rows: the global generator
        for k, i in enumerate(rows):
            gen = requests[i].generator
            if gen is not None:
                noise[k].exponential_(generator=gen)
        sampled = argmax(probs / noise)
        return sampled if all_rows else tokens.index_copy(0, idx, sampled)


def record(
    logits: torch.Tensor,
    scores: torch.Tensor,
    tokens: torch.Tensor,
    requests: list[Request],
    feats: list[int],
) -> None:
    """Keep what requests asked for. Rows are copied out in one gather per kind, so a kept row
    does not pin the whole step's [B, V] tensor."""
    rows = [i for i, f in enumerate(feats) if f & F_RECORD]
    reqs = [requests[i] for i in rows]
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    for attr, flag, source in (
        ("output_scores", "output_scores", scores),
        ("output_logits", "output_logits", logits),
    ):
        chosen = [k for k, r in enumerate(reqs) if getattr(r.sampling_params, flag)]
        if not chosen:
            continue
        kept = source.index_select(0, idx[chosen]).unbind(0)
        for k, row in zip(chosen, kept):
            r = reqs[k]
            if getattr(r, attr) is None:
                setattr(r, attr, [])
            getattr(r, attr).append(row)
    chosen = [k for k, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
    if chosen:
        sel = idx[chosen]
        logp = logits.index_select(0, sel).log_softmax(dim=-1)
        chosen_tokens = tokens.index_select(0, sel)
        top_n = max(reqs[k].sampling_params.logprobs for k in chosen)
        top = logp.topk(min(top_n, logp.shape[-1]), dim=-1) if top_n else None
        own = logp.gather(-1, chosen_tokens[:, None])[:, 0].tolist()
        chosen_tokens = chosen_tokens.tolist()
        top_vals = top.values.tolist() if top is not None else None
        top_ids = top.indices.tolist() if top is not None else None
        for j, k in enumerate(chosen):
            r = reqs[k]
            entry = {chosen_tokens[j]: own[j]}
            n = r.sampling_params.logprobs
            if n:
                for t, v in zip(top_ids[j][:n], top_vals[j][:n]):
                    entry.setdefault(t, v)
            if r.output_logprobs is None:
                r.output_logprobs = []
            r.output_logprobs.append(entry)
