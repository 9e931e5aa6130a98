"""The runner's speculative decoding: after each synchronous step, proposals for the next one.

Two proposers, one per engine:
- prompt lookup (requests with SamplingParams.prompt_lookup_num_tokens > 0; ngram.py), and
- a draft model (EngineConfig.draft_model; draft_model.py), for every eligible request.

A request is eligible when its sampling reads nothing but its own logits row (greedy, or
temperature / top-k / top-p / min-p / typical-p): the rejection sampler then judges each
proposal by exactly the distribution the request samples from. Penalties, bans, min_tokens, user
logits processors, logprobs/scores and beams read the token history or record per token: those
requests decode one token a step, exactly as without speculation, in the same batches.

The number of proposals per request is the policy's (policy.py) for the step's batch size,
capped by the request's own limit (prompt_lookup_num_tokens, num_speculative_tokens) and by the
tokens it has left.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_paged.config import EngineConfig
from hf_paged.core.outputs import ScheduledBatch
from hf_paged.sample.metadata import SamplingRow
from hf_paged.sampling_params import F_FORK, F_RENORM, F_WARP
from hf_paged.spec_decode.ngram import propose_ngram
from hf_paged.spec_decode.policy import SpecPolicy


def eligible(row: SamplingRow) -> bool:
    # F_FORK (n > 1) only concerns a request's first token, sampled before any proposal
    return not row.features & ~(F_WARP | F_RENORM | F_FORK)


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class SpecDecoder:
    def __init__(self, runner, config: EngineConfig, draft=None) -> None:
        self.runner = runner  # the target's ModelRunner: its rows hold every request's tokens
        self.draft = draft  # a DraftProposer, or None: prompt lookup only
        itemsize = next(runner.model.parameters()).element_size()
        ratio = 0.0
        if draft is not None:
            ratio = parameter_bytes(draft.model) / max(parameter_bytes(runner.model), 1)
        self.policy = SpecPolicy(
            config.num_speculative_tokens,
            ratio,
            itemsize,
            fixed=config.speculative_policy == "fixed",
            max_verify_rows=config.max_num_seqs if runner.graphs is not None else None,
        )
        self.max_k = config.num_speculative_tokens
        self.has_proposals = False  # the last step proposed: the next one must be synchronous

    def plan(self, batch_size: int) -> None:
        """Before each step: how many proposals its end makes (the policy's k)."""
        self.policy.plan(batch_size)

    def wants_sync(self) -> bool:
        """Must the next step run synchronously (it verifies proposals, or makes some from the
        tokens on the host)? Prompt-lookup requests are synchronous on their own."""
        return self.has_proposals or (self.draft is not None and self.policy.k_next > 0)

    def propose(
        self,
        batch: ScheduledBatch,
        step,
        sample_idx: np.ndarray,
        accepted: dict[str, list[int]] | None,
    ) -> dict[str, list[int]] | None:
        """Proposals of the requests that got a token this step (batch indices sample_idx),
        after the runner's rows learnt their tokens."""
        out = self._propose(batch, step, sample_idx, accepted)
        self.has_proposals = bool(out)
        return out

    def _propose(self, batch, step, sample_idx, accepted) -> dict[str, list[int]] | None:
        ib = self.runner.input_batch
        rows = step.rows[sample_idx].tolist()
        if self.draft is not None:
            k = self.policy.k_next
            if k == 0:  # no draft forward at all: its KV catches up when speculation resumes
                return None
            limits = {}
            for i, row in zip(sample_idx.tolist(), rows):
                if eligible(ib.sampling[row]):
                    limits[batch.req_ids[i]] = self._room(ib, row, k)
            return self.draft.propose(batch, step, ib, accepted, limits) or None
        lookup = [
            (i, row)
            for i, row in zip(sample_idx.tolist(), rows)
            if ib.sampling[row].params.prompt_lookup_num_tokens and eligible(ib.sampling[row])
        ]
        if not lookup:
            return None
        k = self.policy.k_next
        if k == 0:
            return None
        out = {}
        for i, row in lookup:
            params = ib.sampling[row].params
            room = self._room(ib, row, min(k, params.prompt_lookup_num_tokens))
            if room > 0:
                tokens = ib.token_ids[row, : ib.num_known[row]]
                proposal = propose_ngram(tokens, params.max_matching_ngram_size, room)
                if proposal:
                    out[batch.req_ids[i]] = proposal
        return out or None

    def on_device(self):
        """The draft's last proposals where they are queued on the device, not read yet (a
        step_inputs.DeviceProposals), or None."""
        return self.draft.device_proposals() if self.draft is not None else None

    def before_step(self, batch: ScheduledBatch):
        """Before a step's host preparation: where the draft's proposals are on the device
        (the step's inputs read them there; the host reads them once the forward is queued,
        for the rejection sampler: land()), or None, having read them now."""
        on_device = self.on_device()
        if on_device is None:
            self.land(batch.spec_token_ids)
        return on_device

    def land(self, scheduled: dict[str, list[int]] | None) -> None:
        """Before a step, or once its forward is queued when that reads them on the device
        (on_device()): the draft's last proposals, queued on the device and handed out as
        placeholders (DraftProposer.propose), are read; their values fill the lists handed out
        and this step's scheduled copies of them (the scheduler may have cut a list short)."""
        landed = self.draft.land() if self.draft is not None else None
        if landed and scheduled:
            for rid, tokens in scheduled.items():
                full = landed.get(rid)
                if full is not None and tokens is not full:
                    tokens[:] = full[: len(tokens)]

    @staticmethod
    def _room(ib, row: int, k: int) -> int:
        """At most k, and one fewer than the tokens the request has left (a verify step gives
        its proposals + 1)."""
        return max(0, min(k, int(ib.max_total[row] - ib.num_known[row]) - 1))

    def record(self, scheduled: dict[str, list[int]], accepted: dict[str, list[int]]) -> None:
        proposed = sum(len(scheduled[r]) for r in accepted)
        rejections = sum(len(run) - 1 < len(scheduled[r]) for r, run in accepted.items())
        num_accepted = sum(len(run) - 1 for run in accepted.values())
        self.policy.record(proposed, num_accepted, len(accepted), rejections)
        if self.draft is not None:
            self.draft.on_verified(scheduled, accepted)

    def release(self, req_ids: list[str]) -> None:
        if self.draft is not None:
            self.draft.release(req_ids)

    def shutdown(self) -> None:
        if self.draft is not None:
            self.draft.shutdown()
            self.draft = None

    def stats(self) -> dict:
        p = self.policy
        return {
            "spec_method": "draft_model" if self.draft is not None else "prompt_lookup",
            "spec_num_proposed": p.num_proposed,
            "spec_num_accepted": p.num_accepted,
            "spec_acceptance_rate": p.acceptance_rate,
            "spec_num_verify_steps": p.num_verify_steps,
            "spec_mean_accepted_length": p.mean_accepted_length,
        }


def build_spec_decoder(runner, config: EngineConfig) -> SpecDecoder:
    """The target runner's SpecDecoder: with a DraftProposer when the engine has a draft
    model (its cache as many blocks as the target's)."""
    draft = None
    if config.draft_model is not None:
        from hf_paged.spec_decode.draft_model import DraftProposer

        entries = (runner.last_tokens, config.max_num_seqs)  # (ModelRunner: k entries a row)
        draft = DraftProposer(config.draft_model, config, runner.num_blocks, entries)
    return SpecDecoder(runner, config, draft)
