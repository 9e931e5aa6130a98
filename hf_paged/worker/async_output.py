"""Asynchronous scheduling: a launched step's sampled tokens on their way to the host."""

from __future__ import annotations

import torch

from hf_paged.core.scheduler import ModelRunnerOutput


class PendingOutput:
    """A launched step's sampled tokens on their way to the host (asynchronous scheduling)."""

    def __init__(self, runner, num_seqs, sample_rows, rows, positions, tokens_t, landed=None):
        self.runner = runner
        self.num_seqs = num_seqs
        self.sample_rows = sample_rows  # indices into the step's requests
        self.rows = rows  # their InputBatch rows, and the epochs of those rows now
        self.epochs = runner.input_batch.epoch[rows]
        self.positions = positions  # where each sampled token goes in its row
        self.event = None
        self.host = None
        if tokens_t is not None:
            if landed is not None:  # written into pinned host memory by the step's own kernel
                self.host = landed
            else:
                self.host = runner._host_buffer(len(sample_rows))
                self.host.copy_(tokens_t, non_blocking=True)
            if runner.device.type == "cuda":
                self.event = torch.cuda.Event()
                self.event.record()

    def result(self) -> ModelRunnerOutput:
        if self.host is None:
            return ModelRunnerOutput.from_rows(self.num_seqs, [], [])
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host.numpy().copy()
        # still running (row not released or reused): the token is its row's next input
        ib = self.runner.input_batch
        live = ib.epoch[self.rows] == self.epochs
        ib.token_ids[self.rows[live], self.positions[live]] = tokens[live]
        return ModelRunnerOutput.from_rows(self.num_seqs, self.sample_rows, tokens.tolist())
