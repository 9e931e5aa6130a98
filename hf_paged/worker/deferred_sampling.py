"""Structured output under asynchronous scheduling: a constrained step's sampling, deferred.

The runner queues such a step's forward at once and returns a PendingOutput whose sampling
(mask + sampler + token copies) is queued later, by PendingOutput.launch(); defer_sampling's
docstring has the order and why.
"""

from __future__ import annotations

from hf_paged.worker.async_output import PendingOutput
from hf_paged.worker.host_to_device import to_device


def defer_sampling(
    runner, step, rows_logits, rows, rows_t, sample_idx, previous: PendingOutput | None
) -> PendingOutput:
    """A step with grammar-constrained rows under asynchronous scheduling: its forward is
    queued now, its sampling later. The order, with the GPU beside it:

      host                                            GPU
      launch forward n+1 (sampling deferred)          sample n, forward n+1
      handle step n's output (its tokens land),       forward n+1
        schedule n+2, prepare n+2's inputs,
        matchers accept n's tokens, fill n+1's mask
      queue mask + sample n+1, launch forward n+2     mask, sample n+1, forward n+2

    The grammar's work needs step n's tokens, which land as forward n+1 starts; done after
    the step loop's own work for n+2, all of it overlaps forward n+1, and the GPU goes from
    sampling n+1 to forward n+2 without waiting for the host (when the host's work fits in
    a forward). PendingOutput.launch() runs it: the next execute() just before its forward,
    or finish_async / shutdown when no step follows.

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

    def sample() -> None:
        if previous is not None:
            runner._land(previous)  # (no-op when the step loop has handled its output)
        mask = runner.sampler.grammar.prepare(rows, rows_logits.shape[-1])
        sampled = runner.sampler(rows_logits, rows, ib.penalty_counts, grammar=mask)
        rows_dev = rows_t if rows_t is not None else to_device(row_ids, runner.device)
        runner.last_tokens.index_copy_(0, rows_dev, sampled.tokens)
        host = runner._host_buffer(len(rows))
        host.copy_(sampled.tokens, non_blocking=True)
        pending.sampled(host, sampled.failed)

    pending.deferred = sample
    return pending


def forks(rows) -> bool:
    """A row whose siblings sample their first token from its logits this step (n > 1): the
    sampler adds their rows, and prepares the bitmask itself."""
    return any(r.siblings and r.num_output_tokens == 0 for r in rows)
