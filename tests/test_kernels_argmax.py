"""kernels/argmax.py under the Triton interpreter against torch.argmax(dim=-1): random rows, ties
within and across chunks, -inf and NaN rows, strided rows, and refusals of bad inputs."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_paged.kernels import argmax_rows

am = importlib.import_module("hf_paged.kernels.argmax")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 entries, so a row of a few dozen takes the multi-chunk path."""
    monkeypatch.setattr(am, "_MAX_BLOCK", 16)


@pytest.mark.parametrize("vocab", [1, 13, 16, 61, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunked", [False, True])
def test_argmax_rows_matches_torch(vocab, dtype, chunked, request):
    if chunked:
        request.getfixturevalue("small_chunks")
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(5, vocab, generator=g) * 4).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_first_of_equal_maxima(small_chunks):
    x = torch.zeros(4, 50)
    x[0, [3, 40]] = 7.0  # two chunks hold the maximum: the earlier index
    x[1, [20, 21]] = 7.0  # the same chunk
    x[2, [49, 17, 33]] = 2.0
    # row 3: all equal -> 0
    want = torch.tensor([3, 20, 17, 0])
    assert torch.equal(x.argmax(dim=-1), want)  # what torch does, so the test means it
    assert torch.equal(argmax_rows(x), want)
    assert torch.equal(argmax_rows(x.bfloat16()), want)


def test_argmax_rows_masked_and_nan_rows(small_chunks):
    x = torch.randn(5, 40)
    x[0] = float("-inf")  # every token masked: 0, as torch gives
    x[1, 25] = float("nan")  # NaN is the maximum, as in torch
    x[1, 3] = float("inf")
    x[2, [30, 6]] = float("nan")  # the first NaN
    x[3, 39] = float("inf")
    x[4, :] = float("-inf")
    x[4, 33] = -1e30
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))
    assert got.tolist() == [0, 25, 6, 39, 33]


def test_argmax_rows_strided_rows_and_columns():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 90, generator=g)
    rows = wide[::2, 10:70]  # rows at a stride of 180, a column offset
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    cols = torch.randn(30, 4, generator=g).t()  # entries at a stride: copied first
    assert torch.equal(argmax_rows(cols), cols.argmax(dim=-1))


def test_argmax_rows_no_rows():
    assert argmax_rows(torch.empty(0, 10)).shape == (0,)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.randn(10), r"x must be \[rows, vocab\]"),
        (torch.randint(0, 5, (2, 10)), "x must be float32, float16 or bfloat16"),
        (torch.empty(3, 0), "x has no columns"),
    ],
)
def test_argmax_rows_refuses_bad_input(x, match):
    with pytest.raises(ValueError, match=match):
        argmax_rows(x)
