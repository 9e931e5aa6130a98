"""The penalties' token statistics: one device row per penalised request (prompt mask, output
counts), and the bookkeeping of which output tokens each row has counted.

An output token is counted in one of two ways. The sampler's path counts it on the next
penalised step (sync): from the request's token history on the host, or, while the host has not
read it yet (asynchronous scheduling), from the device copy the runner took of it
(pending_tokens). A sampling graph (hf_paged/worker/decode_sampling.py) counts it on the device
at the draw, inside the graph, so that a run of decode steps needs no host work for its
penalties. Either way SamplingRow.penalty_num_counted says how many of the request's output
tokens the row holds, in order, so no token is counted twice: sync starts after them.

The graph's draws are credited to penalty_num_counted lazily: a run of draws of the same rows is
recorded as (rows, n) and added to the rows only when something else reads or changes the counts
(settle: sync, the runner's pending check), so a steady decode loop touches no row on the host.
"""

from __future__ import annotations

import torch

from hf_paged.sample.metadata import SamplingRow
from hf_paged.worker.host_to_device import device_tensor


class TokenCountPool:
    """Per-request token statistics for penalties, one row per request that uses them:
    prompt_mask[slot, v] (v occurs in the prompt) and output_counts[slot, v] (times v was
    generated). A row is claimed on a request's first penalised step and released when the
    request leaves the running set (the runner's InputBatch.release: finished, aborted, failed,
    preempted, rewritten); a SamplingRow built anew for the same request claims a fresh row.
    The tensors are replaced when the pool grows (a captured graph keys on them)."""

    def __init__(self, device: torch.device, vocab_size: int = 0) -> None:
        self.device = device
        self._size(vocab_size)
        self.owners: list[SamplingRow | None] = []
        self.slot_of: dict[str, int] = {}  # request id -> its row
        # this step's tokens sampled by the step before that the host has not read yet (device),
        # copied by the runner before the forward overwrites them (SamplingRow.pending_index)
        self.pending_tokens: torch.Tensor | None = None
        # draws counted on the device and not yet in the rows' penalty_num_counted: the rows of
        # one sampling graph, how many consecutive draws, the runner's number of the last one
        self._drawn_rows: list[SamplingRow] | None = None
        self._drawn = 0
        self._drawn_step = -1

    def _size(self, vocab_size: int) -> None:
        """The vocabulary is the logits' width (lm_head rows, which may pad the tokenizer's):
        known at the first penalised step."""
        self.vocab_size = vocab_size
        self.prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=self.device)

    # -- draws counted on the device (sampling graphs) ----------------------------------------

    def counted_at_draw(self, rows: list[SamplingRow], step: int) -> None:
        """These rows (one list object per sampling graph's row set) each had one more output
        token counted on the device, at the runner's step `step`."""
        if not self.continues(rows, step):
            self.settle()
            self._drawn_rows = rows
        self._drawn += 1
        self._drawn_step = step

    def continues(self, rows: list[SamplingRow], step: int) -> bool:
        """The step before `step` drew these same rows in a graph: every output token of theirs
        is counted (nothing to sync)."""
        return self._drawn_rows is rows and self._drawn_step == step - 1

    def settle(self) -> None:
        """Credit the recorded draws to their rows (before anything reads penalty_num_counted)."""
        if self._drawn_rows is not None:
            n = self._drawn
            for r in self._drawn_rows:
                r.penalty_num_counted += n
            self._drawn_rows, self._drawn = None, 0

    def counted_before(self, r: SamplingRow, seq_len: int) -> bool:
        """Whether the row's counts hold every output token before position seq_len (settled
        first): its pending token, if any, was counted at its draw."""
        owned = 0 <= r.penalty_slot < len(self.owners) and self.owners[r.penalty_slot] is r
        return owned and r.num_prompt_tokens + r.penalty_num_counted >= seq_len

    # -- rows --------------------------------------------------------------------------------

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
        prompt = device_tensor(request.prompt_token_ids, self.device)
        self.prompt_mask[slot, prompt.clamp(max=self.vocab_size - 1)] = True
        return slot

    def sync(self, requests: list[SamplingRow], vocab_size: int) -> torch.Tensor:
        """Bring the rows of these requests up to date; returns their slots (int64 [R])."""
        self.settle()
        if vocab_size != self.vocab_size:
            if self.slot_of:
                raise RuntimeError("penalty counts: the vocabulary size changed")
            self._size(vocab_size)
            self.owners = []
        slots, new_slots, new_tokens = [], [], []
        pending_slots, pending_rows = [], []
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
            if r.pending_index >= 0:  # the host lands it later: `start` then skips it
                pending_slots.append(slot)
                pending_rows.append(r.pending_index)
                r.penalty_num_counted += 1
                r.pending_index = -1
            slots.append(slot)
        if new_tokens:
            self._count(new_slots, device_tensor(new_tokens, self.device))
        if pending_rows:
            at = device_tensor(pending_rows, self.device)
            self._count(pending_slots, self.pending_tokens.index_select(0, at))
        return device_tensor(slots, self.device)

    def _count(self, slots: list[int], tokens: torch.Tensor) -> None:
        idx = (device_tensor(slots, self.device), tokens.clamp(max=self.vocab_size - 1))
        ones = torch.ones(len(slots), dtype=torch.int32, device=self.device)
        self.output_counts.index_put_(idx, ones, accumulate=True)
