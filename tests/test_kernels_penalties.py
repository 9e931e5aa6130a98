"""kernels/penalties.py under the Triton interpreter against the torch penalties of
hf_paged.sample.logits_processing (the same pool, rows and parameters)."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_paged.kernels.penalties import apply_penalties

from hf_paged.sample.logits_processing import TokenCountPool, _apply_penalties
from hf_paged.sample.metadata import SamplingRow
from hf_paged.sampling_params import SamplingParams

pk = importlib.import_module("hf_paged.kernels.penalties")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("all_rows", [True, False])
def test_penalties_equal_torch(dtype, all_rows, monkeypatch):
    monkeypatch.setattr(pk, "_BLOCK", 16)  # a 40-entry row in three chunks
    vocab = 40
    g = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.4, frequency_penalty=0.1),
        SamplingParams(repetition_penalty=2.0),
    ]
    reqs = [
        SamplingRow(f"r{i}", p, None, torch.randint(0, vocab, (9,), generator=g).tolist(), 4)
        for i, p in enumerate(params)
    ]
    # all rows penalised: the kernel writes every row of a fresh output; otherwise the rows it
    # is not given are copied
    num = 4 if all_rows else 5
    x = (torch.randn(num, vocab, generator=g) * 3).to(dtype)
    x[0, 3] = float("-inf")
    rows = [0, 1, 2, 3] if all_rows else [1, 3, 4, 0]
    requests = [None] * num
    for i, r in zip(rows, reqs):
        requests[i] = r
    pool = TokenCountPool(torch.device("cpu"))
    want = _apply_penalties(x.float(), requests, rows, pool)  # the torch path (CPU)
    slots = torch.tensor([r.penalty_slot for r in reqs])
    got = apply_penalties(
        x,
        torch.tensor(rows),
        slots,
        pool.output_counts,
        pool.prompt_mask,
        torch.tensor([p.repetition_penalty for p in params]),
        torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(got.isinf(), want.isinf())


def test_penalties_refuse_a_pool_of_another_width():
    x = torch.randn(2, 10)
    pool = torch.zeros(2, 12, dtype=torch.int32)
    one = torch.ones(2)
    with pytest.raises(ValueError, match="vocabulary"):
        apply_penalties(x, torch.arange(2), torch.arange(2), pool, pool.bool(), one, one, one)
    with pytest.raises(ValueError, match="presence"):
        p = torch.zeros(2, 10, dtype=torch.int32)
        apply_penalties(x, torch.arange(2), torch.arange(2), p, p.bool(), one, one[:1], one)
