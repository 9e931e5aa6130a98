"""The sampler's warpers equal transformers' own, and its draws follow the warped distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from hf_paged.sample.logits_processing import TokenCountPool, apply_top_k, apply_top_p
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


def _chi2_ok(counts: torch.Tensor, expected: torch.Tensor, n: int) -> bool:
    assert counts[expected == 0].sum() == 0  # never a filtered token
    keep = expected > 0
    chi2 = (((counts[keep] - n * expected[keep]) ** 2) / (n * expected[keep])).sum().item()
    dof = max(int(keep.sum()) - 1, 1)
    return chi2 < dof + 5 * (2 * dof) ** 0.5


@pytest.mark.parametrize(
    "kwargs, warpers",
    [
        (dict(top_k=9, min_p=0.05), [TopKLogitsWarper(9), MinPLogitsWarper(0.05)]),
        (
            dict(temperature=0.7, top_k=50, top_p=0.9),
            [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
        ),
        (dict(top_k=1000), []),  # top_k >= vocab: off
        (dict(top_p=1.0, temperature=1.3), [TemperatureLogitsWarper(1.3)]),
    ],
)
def test_torch_path_distribution(kwargs, warpers):
    """The CPU path (sample_rows_ref through the Sampler) against transformers' warpers."""
    torch.manual_seed(3)
    vocab, n = 64, 20_000
    logits = torch.randn(1, vocab) * 2
    expected = LogitsProcessorList(warpers)(None, logits.clone()).softmax(-1)[0]
    params = SamplingParams(**kwargs)
    draws = Sampler(torch.device("cpu"))(logits.expand(n, -1).contiguous(), [_req(params)] * n)
    assert _chi2_ok(torch.bincount(draws.tokens, minlength=vocab).float(), expected, n)


def test_mixed_batch_with_penalty_seeds_and_slow_rows():
    """Greedy, kernel-sampled, typical-p (full warpers) and penalised rows in one batch: each
    row follows its own options; seeded rows repeat whatever shares their batch."""
    torch.manual_seed(4)
    vocab, n = 16, 6000
    logits = torch.randn(1, vocab) * 1.5
    pool = TokenCountPool(torch.device("cpu"))
    rep = SamplingParams(repetition_penalty=1.8, top_k=10, temperature=0.8)
    reps = [SamplingRow(f"p{i}", rep, None, [2, 5, 7], 3) for i in range(n)]
    greedy = [_req(SamplingParams(temperature=0))]
    typical = [_req(SamplingParams(typical_p=0.6)) for _ in range(n)]
    rows = greedy + reps + typical
    tokens = Sampler(torch.device("cpu"))(logits.expand(len(rows), -1).contiguous(), rows, pool)
    tokens = tokens.tokens
    assert tokens[0] == logits[0].argmax()
    penalised = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([[2, 5, 7]]), logits.clone())
    exp_rep = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(10)])(
        None, penalised
    ).softmax(-1)[0]
    assert _chi2_ok(torch.bincount(tokens[1 : n + 1], minlength=vocab).float(), exp_rep, n)
    exp_typ = TypicalLogitsWarper(0.6)(None, logits.clone()).softmax(-1)[0]
    assert _chi2_ok(torch.bincount(tokens[n + 1 :], minlength=vocab).float(), exp_typ, n)

    def seeded(seed, others):
        gen = torch.Generator().manual_seed(seed)
        row = SamplingRow("s", SamplingParams(top_p=0.8, min_p=0.01), gen, [3], 1)
        out = []
        for step in range(8):
            batch = [_req(SamplingParams(top_k=3)) for _ in range(others)] + [row]
            x = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(step))
            x[-1] = logits[0]
            out.append(Sampler(torch.device("cpu"))(x, batch).tokens[-1].item())
        return out

    alone = seeded(11, 0)
    assert seeded(11, 5) == alone
    assert seeded(12, 0) != alone or seeded(13, 0) != alone
