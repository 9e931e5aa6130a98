"""Repetition, presence and frequency penalties inside a decode step's sampling graph.

Why: a penalised decode step used to leave the sampling graph for the sampler, which every step
walked the rows on the host (their pool rows, the token sampled last step), copied its parameter
rows and launched the penalty kernel, the parameter copies and the draw one by one (on the H200,
TinyLlama-1.1B shape: sampling with a repetition penalty at 0.56x of greedy tok/s, without it
0.95x). Here the penalties are part of the sampling graph: kernels/penalties.py reads the decode
graph's logits, the per-row penalties (a static buffer sent when the rows change) and the
device-resident counts of hf_paged/sample/token_counts.py, and after the draw the graph adds each
penalised row's token to its counts, on the device. A run of decode steps of the same rows thus
needs no host work for its penalties and no token from the host (the steps stay asynchronous);
the pool is synced on the host (new rows, tokens drawn outside the graph, a token still in
flight) only when the run is broken (TokenCountPool.continues).

The arithmetic is the sampler's: the same kernel on the same float32 rows. Rows without a
penalty in the same graph get the identity values (1, 0, 0: x / 1 - 0 * count - 0 is x exactly)
and add nothing to any count.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_paged.sample.metadata import SamplingRow
from hf_paged.sample.token_counts import TokenCountPool
from hf_paged.sampling_params import F_PRESENCE, F_REPETITION
from hf_paged.worker.host_to_device import to_device

PENALTIES = F_REPETITION | F_PRESENCE
_REP, _PRES, _FREQ, _COUNTED = range(4)
_IDENTITY = (1.0, 0.0, 0.0, 0.0)


class GraphPenalties:
    """The penalised rows of the sampling graph's current row set: send() when the rows change,
    sync() before each draw, apply() and count() inside the graph, drew() after it."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.device = device
        # per row: the three penalties, and 1.0 where the row's token is counted (float32 rows
        # on 16-byte boundaries, as the sampling parameters: Triton's alignment key)
        self.values = torch.zeros((len(_IDENTITY), width), dtype=torch.float32, device=device)
        self.slots = torch.zeros(width, dtype=torch.long, device=device)  # pool rows
        self.row_ids = torch.arange(width, dtype=torch.long, device=device)
        self.rows: list[SamplingRow] = []  # the penalised rows, in batch order
        self._at: np.ndarray = np.zeros(0, dtype=np.int64)  # their indices in the batch
        self._bucket = 0

    @property
    def active(self) -> bool:
        return bool(self.rows)

    def send(self, rows: list[SamplingRow], bucket: int) -> None:
        """A new row set: its penalties to the device (rows without one: the identity)."""
        at = [k for k, r in enumerate(rows) if r.features & PENALTIES]
        self.rows = [rows[k] for k in at]  # a new list: the pool's record of draws keys on it
        self._at = np.asarray(at, dtype=np.int64)
        self._bucket = bucket
        if not at:
            return
        host = np.empty((len(_IDENTITY), bucket), dtype=np.float32)
        host[:] = np.asarray(_IDENTITY, dtype=np.float32)[:, None]
        ps = [r.params for r in self.rows]
        host[_REP, at] = [p.repetition_penalty for p in ps]
        host[_PRES, at] = [p.presence_penalty for p in ps]
        host[_FREQ, at] = [p.frequency_penalty for p in ps]
        host[_COUNTED, at] = 1.0
        self.values[:, :bucket].copy_(to_device(host, self.device))

    def sync(self, pool: TokenCountPool, vocab: int, step: int) -> None:
        """Before the draw: unless the step before drew these rows in the graph, bring their
        counts up to date and send their pool rows."""
        if pool.continues(self.rows, step):
            return
        pool.sync(self.rows, vocab)
        slots = np.zeros(self._bucket, dtype=np.int64)  # other rows: slot 0, with no effect
        slots[self._at] = [r.penalty_slot for r in self.rows]
        self.slots[: self._bucket].copy_(to_device(slots, self.device))

    def drew(self, pool: TokenCountPool, step: int) -> None:
        pool.counted_at_draw(self.rows, step)

    @staticmethod
    def tensors_key(pool: TokenCountPool) -> tuple[int, int]:
        """What a captured graph read of the pool: it is recaptured when the pool grows."""
        return pool.output_counts.data_ptr(), pool.prompt_mask.data_ptr()

    # -- inside the graph -----------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, pool: TokenCountPool, bucket: int) -> torch.Tensor:
        """float32 [bucket, V]: the logits with each row's penalties."""
        from hf_paged.kernels.penalties import apply_penalties

        v = self.values[:, :bucket]
        return apply_penalties(
            logits,
            self.row_ids[:bucket],
            self.slots[:bucket],
            pool.output_counts,
            pool.prompt_mask,
            v[_REP],
            v[_PRES],
            v[_FREQ],
        )

    def count(self, tokens: torch.Tensor, pool: TokenCountPool, bucket: int) -> None:
        """Each penalised row's drawn token into its output counts (others add 0 to slot 0's)."""
        counts = pool.output_counts
        flat = self.slots[:bucket] * counts.shape[1] + tokens
        added = self.values[_COUNTED, :bucket].to(torch.int32)
        counts.view(-1).index_add_(0, flat, added)
