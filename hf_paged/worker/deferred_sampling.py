"""A step's sampling by the sampler: deferred (structured output), or now.

Under asynchronous scheduling the runner queues a step with grammar-constrained rows at once and
returns a PendingOutput whose sampling (mask + sampler + token copies) is queued later, by
PendingOutput.launch(); defer_sampling's docstring has the order and why. Other steps that need
the sampler sample now (sample_now).
"""

from __future__ import annotations

import numpy as np

from hf_paged.sampling_params import F_FORK, F_STRUCTURED
from hf_paged.worker.async_output import PendingOutput
from hf_paged.worker.host_to_device import to_device


def defer_sampling(
    runner, step, rows_logits, rows, rows_t, sample_idx, previous: PendingOutput | None
) -> PendingOutput:
    """A step with grammar-constrained rows under asynchronous scheduling: its forward is
    queued now, its sampling later. The order, with the GPU beside it:

      host                                            GPU
      launch forward n+1 (sampling deferred)          sample n, forward n+1
      step n's tokens land: the helper thread starts  forward n+1
        accepting them and filling n+1's mask;
        the step loop handles step n's output,
        schedules n+2, prepares n+2's inputs
      take the mask, queue mask + sample n+1,         mask, sample n+1, forward n+2
        launch forward n+2

    The grammar's work needs step n's tokens, which land as forward n+1 starts; from then on
    it runs on the helper thread beside the step loop's own work for n+2 (the two xgrammar
    calls release the GIL), all of it while the GPU computes forward n+1, and the GPU goes from
    sampling n+1 to forward n+2 without waiting for the host (when the host's work fits in a
    forward). ModelRunner._land starts the helper (DeferredSampling.start_grammar); launch()
    (PendingOutput.launch) queues the sampling: the next execute() just before its forward, or
    finish_async / shutdown when no step follows.

    Rows may be released (their requests ended) and reused before the sampling is queued:
    it holds its own SamplingRows, writes a released row's last_tokens entry before the
    forward of the row's new owner (whose prompt does not read it), and the tokens of a
    released row are dropped by the epoch check. No such step has a penalty row (those
    requests run synchronously), so the penalty pool is not touched. previous: the step
    launched before, whose tokens the matchers accept first."""
    ib = runner.input_batch
    row_ids = step.rows[sample_idx]
    pending = PendingOutput(
        len(step.rows), sample_idx.tolist(), row_ids, step.seq_lens[sample_idx], None,
        ib.epoch[row_ids], runner.device.type == "cuda",
    )  # fmt: skip
    features = int(np.bitwise_or.reduce(ib.features[row_ids]))
    pending.deferred = DeferredSampling(
        runner, pending, rows_logits, rows, rows_t, previous, features
    )
    return pending


def sample_now(runner, step, row_ids: np.ndarray, rows, rows_logits):
    """The sampler on a step's rows now (input-batch rows row_ids; rows: their SamplingRows);
    it prepares a constrained step's bitmask itself, once the previous step's tokens are in."""
    ib = runner.input_batch
    if step.features & F_STRUCTURED and runner._pending is not None:
        runner._land(runner._pending)  # the grammar matchers need the previous step's tokens
    features = int(np.bitwise_or.reduce(ib.features[row_ids]))
    return runner.sampler(rows_logits, rows, ib.penalty_counts, features=features)


class DeferredSampling:
    """A deferred step's sampling (defer_sampling has the order); calling it queues it."""

    def __init__(self, runner, pending, rows_logits, rows, rows_t, previous, features) -> None:
        self.runner, self.pending = runner, pending
        self.rows_logits, self.rows, self.rows_t = rows_logits, rows, rows_t
        self.features = features  # every feature bit of the rows (the sampler's dispatch)
        self.previous = previous  # the step whose tokens the matchers accept first
        self.early = None  # the bitmask under way on the helper thread (EarlyMask)

    def start_grammar(self) -> None:
        """The previous step's tokens are in the rows: start the grammar's work (once)."""
        if self.early is None:
            grammar = self.runner.sampler.grammar
            self.early = grammar.start(self.rows, self.rows_logits.shape[-1])

    def __call__(self) -> None:
        runner, rows = self.runner, self.rows
        if self.previous is not None:
            runner._land(self.previous)  # (no-op when the step loop has handled its output)
        if self.early is not None:
            mask = self.early.result()
        else:
            mask = runner.sampler.grammar.prepare(rows, self.rows_logits.shape[-1])
        ib = runner.input_batch
        sampled = runner.sampler(
            self.rows_logits, rows, ib.penalty_counts, grammar=mask, features=self.features
        )
        rows_dev = self.rows_t
        if rows_dev is None:
            rows_dev = to_device(self.pending.rows, runner.device)
        runner.last_tokens.index_copy_(0, rows_dev, sampled.tokens)
        host = runner._host_buffer(len(rows))
        host.copy_(sampled.tokens, non_blocking=True)
        self.pending.sampled(host, sampled.failed)


def forks(rows, features: int) -> bool:
    """A row whose siblings sample their first token from its logits this step (n > 1): the
    sampler adds their rows, and prepares the bitmask itself. features: the step's feature
    bits (no F_FORK: no row to look at)."""
    return bool(features & F_FORK) and any(r.siblings and r.num_output_tokens == 0 for r in rows)
