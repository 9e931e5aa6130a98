"""A step in which some requests computed proposals (speculative decoding): the model runner's
sampling for it. Verified requests go through the rejection sampler with their proposals + 1
logits rows; the others through the sampler with their one row. Never asynchronous: the engine
steps synchronously while requests have proposals (EngineCore._can_run_ahead)."""

from __future__ import annotations

import numpy as np

from hf_paged.core.outputs import ModelRunnerOutput
from hf_paged.spec_decode.rejection_sampler import verify
from hf_paged.worker.host_to_device import to_device


def verify_step(runner, batch, step, kept, logits, prompt_logprobs) -> ModelRunnerOutput:
    """A step in which some requests computed proposals: those go through the rejection
    sampler (spec_decode/rejection_sampler.py) with their proposals + 1 logits rows, the
    others through the sampler with their one row. Each verified request gets its
    accepted proposals and one token of the target's."""
    ib = runner.input_batch
    sample_idx = kept.sample_idx
    counts, first = kept.spec_count, kept.spec_first
    plain = np.flatnonzero(counts == 1)
    spec = np.flatnonzero(counts > 1)
    tokens = [0] * len(sample_idx)
    extra = {}
    if plain.size:
        rows = [ib.sampling[int(r)] for r in step.rows[sample_idx[plain]].tolist()]
        sampled = runner.sampler(
            logits[to_device(first[plain], runner.device)], rows, ib.penalty_counts
        )
        for n, t in zip(plain.tolist(), sampled.tokens.tolist()):
            tokens[n] = t
        extra = sampled.runner_output_fields()
    idx = [j for n in spec.tolist() for j in range(first[n], first[n] + counts[n])]
    req_ids = [batch.req_ids[i] for i in sample_idx[spec].tolist()]
    verified = []
    if req_ids:
        verified = verify(
            logits[to_device(np.asarray(idx, dtype=np.int64), runner.device)],
            [ib.sampling[int(r)] for r in step.rows[sample_idx[spec]].tolist()],
            [batch.spec_token_ids[r] for r in req_ids],
        )
    for n, run in zip(spec.tolist(), verified):
        tokens[n] = run[-1]
    accepted = dict(zip(req_ids, verified))
    # rows learn their tokens: one each for plain rows, the accepted run for verified ones
    rows, positions = step.rows[sample_idx], step.seq_lens[sample_idx]
    if plain.size:
        runner.input_batch.add_tokens(
            rows[plain], positions[plain], [tokens[n] for n in plain.tolist()]
        )
    for n, run in zip(spec.tolist(), verified):
        row = int(rows[n])
        start = int(step.total_tokens[sample_idx[n]])
        ib.add_run(row, start, run)
    if runner.spec is not None:
        runner.spec.record(batch.spec_token_ids, accepted)
    proposals = runner.spec.propose(batch, step, sample_idx, accepted) if runner.spec else None
    return ModelRunnerOutput.from_rows(
        len(batch),
        sample_idx.tolist(),
        tokens,
        prompt_logprobs=prompt_logprobs,
        accepted_token_ids=accepted,
        spec_token_ids=proposals,
        **extra,
    )
