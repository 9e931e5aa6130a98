"""The sampler's warpers equal transformers' own, and its draws follow the warped distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.sample.logits_processing import apply_top_k, apply_top_p
from hf_paged.sample.metadata import SamplingRow
from hf_paged.sample.sampler import Sampler
from hf_paged.sampling_params import SamplingParams


@pytest.mark.parametrize("k", [1, 3, 17, 64])
def test_top_k_equals_transformers(k):
    logits = torch.randn(4, 64)
    logits[0, :5] = 2.0  # ties at the k-th value are kept by both
    ours = apply_top_k(logits, torch.full((4,), k))
    ref = TopKLogitsWarper(top_k=k)(None, logits.clone())
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_equals_transformers(p):
    logits = torch.randn(4, 64) * 3
    ours = apply_top_p(logits, torch.full((4,), p))
    ref = TopPLogitsWarper(top_p=p)(None, logits.clone())
    assert torch.equal(ours, ref)


def test_per_row_parameters_mix_in_one_batch():
    logits = torch.randn(3, 50)
    ours = apply_top_p(apply_top_k(logits, torch.tensor([0, 5, 10])), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.isfinite(ours[0]).all()
    assert torch.isfinite(ours[1]).sum() == 5
    ref2 = TopPLogitsWarper(0.5)(None, TopKLogitsWarper(10)(None, logits[2:].clone()))
    assert torch.equal(ours[2:], ref2)


def _req(params: SamplingParams) -> SamplingRow:
    return SamplingRow("r", params, None, [3], 1)


def test_draws_follow_the_warped_distribution():
    """Chi-square over 20k draws against the distribution transformers' warpers define."""
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9)
    warped = TopPLogitsWarper(0.9)(
        None, TopKLogitsWarper(8)(None, TemperatureLogitsWarper(0.7)(None, logits.clone()))
    )
    expected = warped.softmax(-1)[0]
    n = 20_000
    sampler = Sampler(torch.device("cpu"))
    draws = sampler(logits.expand(n, -1).contiguous(), [_req(params)] * n).tokens
    counts = torch.bincount(draws, minlength=12).float()
    assert counts[expected == 0].sum() == 0  # never a filtered token
    keep = expected > 0
    chi2 = (((counts[keep] - n * expected[keep]) ** 2) / (n * expected[keep])).sum().item()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5  # ~5 sigma; a wrong distribution gives hundreds


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.randn(3, 30)
    reqs = [
        _req(SamplingParams(temperature=0)),
        _req(SamplingParams()),
        _req(SamplingParams(temperature=0)),
    ]
    out = Sampler(torch.device("cpu"))(logits, reqs).tokens
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
