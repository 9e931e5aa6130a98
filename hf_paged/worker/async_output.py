"""Asynchronous scheduling: a launched step's sampled tokens on their way to the host."""

from __future__ import annotations

import numpy as np
import torch


class PendingOutput:
    """A launched step's sampled tokens, being copied into pinned host memory (or written there
    by the decode graph's own kernel). ModelRunner.finish_async reads them once they landed."""

    def __init__(
        self,
        num_seqs: int,
        sample_rows: list[int],
        rows: np.ndarray,
        positions: np.ndarray,
        host: torch.Tensor | None,
        epochs: np.ndarray,
        on_cuda: bool,
    ) -> None:
        self.num_seqs = num_seqs
        self.sample_rows = sample_rows  # indices into the step's batch
        self.rows = rows  # their InputBatch rows, and the epochs of those rows at launch
        self.epochs = epochs
        self.positions = positions  # where each sampled token goes in its row
        self.host = host  # None: nothing was sampled
        # request id -> what failed its sampling (a grammar that refused its token), or None
        self.failed: dict | None = None
        self.on_cuda = on_cuda
        self.landed = False  # its tokens were written into their rows (ModelRunner._land)
        self.tokens = None
        self.event = None
        # a step whose sampling waits for its grammar bitmask (structured output): the call
        # that queues it, run by launch() once the previous step's output is handled
        self.deferred = None
        # a plain greedy decode step that replayed a CUDA graph: its StepInputs, so more steps
        # of the same rows can replay the graph again (model_runner.queue_decode_run)
        self.decode_step = None
        # the sampled tokens on the device (int64 [len(sample_rows)]), as the step left them: a
        # decode graph's static output is overwritten by its next replay
        self.device_tokens = None
        if host is not None and on_cuda:  # the copy (or the graph's write) is queued
            self.event = torch.cuda.Event()
            self.event.record()

    def launch(self) -> None:
        """Queue a deferred sampling (no-op when there is none or it is queued already)."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            deferred()

    def sampled(self, host: torch.Tensor, failed: dict | None) -> None:
        """The deferred sampling is queued: its tokens are on their way into host."""
        self.host = host
        self.failed = failed
        if self.on_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> np.ndarray | None:
        """The tokens (int64 [len(sample_rows)], or [steps, len(sample_rows)] for a run of
        decode steps) once on the host; None if none were sampled."""
        if self.deferred is not None:
            raise RuntimeError("a deferred sampling must be launched before its tokens are read")
        if self.host is None:
            return None
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy().copy()
