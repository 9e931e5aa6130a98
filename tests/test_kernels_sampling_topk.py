"""kernels/sampling_topk.py under the Triton interpreter: the same token as sample_rows_ref for the
same uniform (mixed per-row options, ties at the k-th value past the candidate list, -inf
entries, bf16, strided rows), the distribution of each option against transformers' warpers over
stratified uniforms, the sampler's split of a batch between this kernel and kernels/sampling.py,
and the refusals."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_paged.kernels.sampling import sample_rows_ref
from hf_paged.kernels.sampling_topk import sample_rows_topk
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.sample.sampler import _draw_rows

tk = importlib.import_module("hf_paged.kernels.sampling_topk")
sm = importlib.import_module("hf_paged.kernels.sampling")


@pytest.fixture
def small(monkeypatch):
    """Lists of 8 and chunks of 16 entries, so a row of a few dozen takes several chunks and
    its ties can run past the list."""
    monkeypatch.setattr(tk, "_MIN_KP", 8)
    monkeypatch.setattr(tk, "_BLOCK", 16)
    monkeypatch.setattr(sm, "_BLOCK", 16)
    monkeypatch.setattr(sm, "_SUB", 8)


def _mixed(n, vocab, k_hi, g):
    temp = torch.rand(n, generator=g) + 0.3
    top_k = torch.randint(1, k_hi + 1, (n,), generator=g)
    top_p = torch.where(torch.rand(n, generator=g) < 0.3, 1.0, torch.rand(n, generator=g) * 0.95)
    min_p = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, torch.rand(n, generator=g) * 0.3)
    return temp, top_k, top_p.clamp(min=0.05), min_p, torch.rand(n, generator=g)


def test_kernel_equals_reference_on_mixed_rows(small):
    g = torch.Generator().manual_seed(0)
    n, vocab = 24, 40
    x = torch.randn(n, vocab, generator=g) * 3
    x[0] = 1.5  # all equal: the k-th value's ties fill the row, far past the list
    x[1, :30] = float("-inf")  # fewer finite entries than some top_k
    x[2, ::3] = float("-inf")
    x[3, :8] = x[3].max() + 1  # an 8-way tie at the top
    x[4] = (x[4] * 4).round() / 4  # many ties everywhere
    x[5] = (x[5] > 0).float()  # two values: ~20-way ties at the k-th value
    temp, top_k, top_p, min_p, u = _mixed(n, vocab, 8, g)
    top_k[5] = 3
    want = sample_rows_ref(x, temp, top_k, top_p, min_p, u)
    assert torch.equal(sample_rows_topk(x, temp, top_k, top_p, min_p, u, 8), want)
    # a longer list than the largest k; rows of a wider tensor; bfloat16 logits
    assert torch.equal(sample_rows_topk(x, temp, top_k, top_p, min_p, u, 16), want)
    wide = torch.randn(n, vocab + 7, generator=g)
    got = sample_rows_topk(wide[:, :vocab], temp, top_k, top_p, min_p, u, 8)
    assert torch.equal(got, sample_rows_ref(wide[:, :vocab], temp, top_k, top_p, min_p, u))
    xb = x.bfloat16()
    got = sample_rows_topk(xb, temp, top_k, top_p, min_p, u, 8)
    assert torch.equal(got, sample_rows_ref(xb, temp, top_k, top_p, min_p, u))


def test_ties_past_the_list_are_all_drawn(small):
    """top_k 2 on a row whose second value is shared by 29 entries: every one of them can be
    drawn (TopKLogitsWarper keeps them all), though the list holds 8."""
    vocab, n = 40, 256
    x = torch.zeros(1, vocab)
    x[0, 17] = 2.0
    x[0, :5] = -1.0
    x[0, 30:35] = -2.0
    u = (torch.arange(n) + 0.5) / n
    ones = torch.ones(n)
    args = (x.expand(n, -1), ones, torch.full((n,), 2), ones, torch.zeros(n), u)
    tokens = sample_rows_topk(*args, 2)
    assert torch.equal(tokens, sample_rows_ref(*args))
    kept = TopKLogitsWarper(2)(None, x.clone()).isfinite()[0]
    assert set(tokens.tolist()) == set(kept.nonzero()[:, 0].tolist())
    assert len(set(tokens.tolist())) == 30


OPTIONS = {
    "top_k": (dict(top_k=6), [TopKLogitsWarper(6)]),
    "top_k_temperature": (dict(top_k=5, temperature=0.6), [
        TemperatureLogitsWarper(0.6), TopKLogitsWarper(5)]),
    "top_k_top_p": (dict(top_k=8, top_p=0.7), [TopKLogitsWarper(8), TopPLogitsWarper(0.7)]),
    "top_k_min_p": (dict(top_k=7, min_p=0.1), [TopKLogitsWarper(7), MinPLogitsWarper(0.1)]),
    "all": (dict(temperature=0.7, top_k=8, top_p=0.9, min_p=0.02), [
        TemperatureLogitsWarper(0.7), TopKLogitsWarper(8), TopPLogitsWarper(0.9),
        MinPLogitsWarper(0.02)]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIONS))
def test_kernel_distribution_per_option(name, small):
    torch.manual_seed(1)
    vocab, n = 24, 96
    logits = torch.randn(1, vocab) * 2.5
    kwargs, warpers = OPTIONS[name]
    expected = LogitsProcessorList(warpers)(None, logits.clone()).softmax(-1)[0]
    p = dict(temperature=1.0, top_p=1.0, min_p=0.0) | kwargs
    full = lambda v: torch.full((n,), float(v))  # noqa: E731
    u = (torch.arange(n) + 0.5) / n  # stratified: token i gets n * p_i of them, +-1
    x = logits.expand(n, -1).contiguous()
    params = (full(p["temperature"]), full(p["top_k"]).int(), full(p["top_p"]), full(p["min_p"]))
    draws = sample_rows_topk(x, *params, u, p["top_k"])
    counts = torch.bincount(draws, minlength=vocab).float()
    assert counts[expected == 0].sum() == 0  # never a filtered token
    assert ((counts - n * expected).abs() <= 1.0 + 1e-4).all(), (counts, n * expected)


def test_sampler_splits_a_batch_between_the_kernels(small):
    """Rows with a top_k the list holds take this kernel, the others (top_k off, or past
    TOPK_CAP) the search kernel; each row's token is the reference's."""
    g = torch.Generator().manual_seed(3)
    n, vocab = 12, 40
    x = torch.randn(n, vocab, generator=g) * 2
    temp, top_k, top_p, min_p, u = _mixed(n, vocab, 8, g)
    top_ks = top_k.tolist()
    for i in (1, 4, 9):
        top_ks[i] = 0  # off: the search kernel
    top_ks[6] = tk.TOPK_CAP + 1  # past the cap (>= vocab here: off)
    top_k = torch.tensor(top_ks, dtype=torch.float32)
    params = [temp, top_k, top_p, min_p]
    got = _draw_rows(x, params, u, top_ks, kernels=True)
    assert torch.equal(got, sample_rows_ref(x, temp, top_k.int(), top_p, min_p, u))


def test_bad_k_max_is_refused():
    x = torch.randn(3, 100)
    ones = torch.ones(3)
    args = (x, ones, torch.full((3,), 5), ones, torch.zeros(3), torch.rand(3))
    with pytest.raises(ValueError, match="k_max"):
        sample_rows_topk(*args, 0)
    with pytest.raises(ValueError, match="k_max"):
        sample_rows_topk(*args, tk.TOPK_CAP + 1)
    with pytest.raises(ValueError, match="k_max"):
        sample_rows_topk(*args, 70)  # a list of 128 > the vocabulary
    with pytest.raises(ValueError, match="top_k"):
        sample_rows_topk(x, ones, torch.full((2,), 5), ones, torch.zeros(3), torch.rand(3), 5)
