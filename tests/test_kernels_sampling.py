"""kernels/sampling.py under the Triton interpreter: the same token as sample_rows_ref for the
same uniform (mixed per-row options, edge rows, several chunks a row), and the distribution of
each option against transformers' warpers over a stratified grid of uniforms (the kernel is a
deterministic map u -> token, so N evenly spread u give each token N * prob draws, +-1).
sample_rows_ref, the CPU path, is checked by chi-square over random draws in
tests/test_sampler.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_paged.kernels.sampling import sample_rows, sample_rows_ref
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

sm = importlib.import_module("hf_paged.kernels.sampling")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 entries and pivot tiles of 8, so a row of a few dozen takes many chunks."""
    monkeypatch.setattr(sm, "_BLOCK", 16)
    monkeypatch.setattr(sm, "_SUB", 8)


@pytest.fixture
def one_chunk(monkeypatch):
    """A 24-entry row in one chunk and one pivot tile: the interpreter's fastest."""
    monkeypatch.setattr(sm, "_BLOCK", 32)
    monkeypatch.setattr(sm, "_SUB", 32)


def _params(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    return (
        full(temperature, torch.float32),
        full(top_k, torch.int64),
        full(top_p, torch.float32),
        full(min_p, torch.float32),
    )


def test_kernel_equals_reference_on_mixed_rows(small_chunks):
    g = torch.Generator().manual_seed(0)
    n, vocab = 24, 40
    x = torch.randn(n, vocab, generator=g) * 3
    x[0] = 1.5  # all equal: every cut keeps the whole row
    x[1, :30] = float("-inf")  # fewer finite entries than top_k
    x[2, ::3] = float("-inf")
    x[3, :8] = x[3].max() + 1  # an 8-way tie at the top
    x[4] = (x[4] * 4).round() / 4  # many ties everywhere
    temp = torch.rand(n, generator=g) + 0.3
    top_k = torch.randint(0, 48, (n,), generator=g)  # some >= vocab (off)
    top_k[1] = 25
    top_p = torch.where(torch.rand(n, generator=g) < 0.3, 1.0, torch.rand(n, generator=g) * 0.95)
    top_p = top_p.clamp(min=0.05)
    min_p = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, torch.rand(n, generator=g) * 0.3)
    u = torch.rand(n, generator=g)
    want = sample_rows_ref(x, temp, top_k, top_p, min_p, u)
    assert torch.equal(sample_rows(x, temp, top_k, top_p, min_p, u), want)
    # rows of a wider tensor (row stride > vocab) and bfloat16 logits
    wide = torch.randn(n, vocab + 7, generator=g)
    got = sample_rows(wide[:, :vocab], temp, top_k, top_p, min_p, u)
    assert torch.equal(got, sample_rows_ref(wide[:, :vocab], temp, top_k, top_p, min_p, u))
    xb = x.bfloat16()
    got = sample_rows(xb, temp, top_k, top_p, min_p, u)
    assert torch.equal(got, sample_rows_ref(xb, temp, top_k, top_p, min_p, u))


def _seen(x, temp, top_k, top_p, min_p, n):
    """The tokens each row gives over n stratified uniforms (one launch of rows * n rows)."""
    rows = x.shape[0]
    u = ((torch.arange(n) + 0.5) / n).repeat_interleave(rows)
    rep = lambda t: t.repeat(n)  # noqa: E731
    args = (x.repeat(n, 1), rep(temp), rep(top_k), rep(top_p), rep(min_p), u)
    tokens = sample_rows(*args).view(n, rows)
    assert torch.equal(tokens.view(-1), sample_rows_ref(*args))
    return [set(tokens[:, r].tolist()) for r in range(rows)]


def test_edge_rows_keep_what_the_rule_says(small_chunks):
    vocab = 20
    x = torch.zeros(6, vocab)
    x[1, 5] = float("-inf")
    x[2] = torch.arange(vocab, dtype=torch.float32)
    x[3, 7] = 3.0  # one clear maximum, min_p 1: only it
    x[4, 3] = float("-inf")
    x[4, 9] = 1.0
    x[5, 11] = 0.5
    top_k = torch.tensor([0, vocab, 3, 0, 2, 0])
    top_p = torch.tensor([0.3, 1.0, 1.0, 1.0, 1.0, 1e-6])
    min_p = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    seen = _seen(x, torch.ones(6), top_k, top_p, min_p, 32)
    assert seen[0] == set(range(vocab))  # all equal, top_p 0.3: a tie at the cut is kept whole
    assert seen[1] == set(range(vocab)) - {5}  # top_k = vocab: off; -inf never drawn
    assert seen[2] == {17, 18, 19}
    assert seen[3] == {7}
    # top_k 2: the max and every token tied with the 2nd largest value, as TopKLogitsWarper
    kept = TopKLogitsWarper(2)(None, x[4:5].clone()).isfinite()[0]
    assert seen[4] == set(kept.nonzero()[:, 0].tolist()) == set(range(vocab)) - {3}
    assert seen[5] == {11}  # a tiny top_p keeps the most likely token


OPTIONS = {
    "temperature": (dict(temperature=0.6), [TemperatureLogitsWarper(0.6)]),
    "top_k": (dict(top_k=6), [TopKLogitsWarper(6)]),
    "top_p": (dict(top_p=0.8), [TopPLogitsWarper(0.8)]),
    "min_p": (dict(min_p=0.1), [MinPLogitsWarper(0.1)]),
    "min_p_with_top_k": (dict(top_k=9, min_p=0.05), [TopKLogitsWarper(9), MinPLogitsWarper(0.05)]),
    "all": (
        dict(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02),
        [
            TemperatureLogitsWarper(0.7),
            TopKLogitsWarper(12),
            TopPLogitsWarper(0.9),
            MinPLogitsWarper(0.02),
        ],
    ),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_kernel_distribution_per_option(name, one_chunk):
    torch.manual_seed(1)
    vocab, n = 24, 96
    logits = torch.randn(1, vocab) * 2.5
    kwargs, warpers = OPTIONS[name]
    expected = LogitsProcessorList(warpers)(None, logits.clone()).softmax(-1)[0]
    u = (torch.arange(n) + 0.5) / n  # stratified: token i gets n * p_i of them, +-1
    draws = sample_rows(logits.expand(n, -1).contiguous(), *_params(n, **kwargs), u)
    counts = torch.bincount(draws, minlength=vocab).float()
    assert counts[expected == 0].sum() == 0  # never a filtered token
    assert ((counts - n * expected).abs() <= 1.0 + 1e-4).all(), (counts, n * expected)
    keep = expected > 0
    chi2 = (((counts[keep] - n * expected[keep]) ** 2) / (n * expected[keep])).sum().item()
    dof = max(int(keep.sum()) - 1, 1)
    assert chi2 < dof + 5 * (2 * dof) ** 0.5


def test_bad_shapes_are_refused():
    x = torch.randn(3, 10)
    temp, top_k, top_p, min_p = _params(3)
    with pytest.raises(ValueError, match="top_k"):
        sample_rows(x, temp, top_k[:2], top_p, min_p, torch.rand(3))
    with pytest.raises(ValueError, match="logits"):
        sample_rows_ref(x[0], temp, top_k, top_p, min_p, torch.rand(3))
    with pytest.raises(ValueError, match="floating"):
        sample_rows(x.long(), temp, top_k, top_p, min_p, torch.rand(3))
