"""kernels/embedding.py under the Triton interpreter against torch's embedding of the resolved
token ids (torch.where(pending, last_tokens[rows], input_ids)), and its refusals of bad inputs."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_paged.kernels import embed_tokens, embed_tokens_ref

emb = importlib.import_module("hf_paged.kernels.embedding")


def _table(vocab, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=g).to(dtype)


@pytest.mark.parametrize("hidden", [8, 40, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_tokens_matches_torch(hidden, dtype):
    w = _table(50, hidden, dtype)
    ids = torch.tensor([3, 0, 49, 7, 7])
    got = embed_tokens(w, ids)
    assert torch.equal(got, torch.nn.functional.embedding(ids, w))


def test_embed_tokens_takes_pending_tokens_from_last_tokens(monkeypatch):
    monkeypatch.setattr(emb, "_MAX_BLOCK_H", 16)  # hidden 40: three programs a token
    w = _table(30, 40, torch.bfloat16, seed=1)
    last_tokens = torch.tensor([11, 22, 5, 29, 0, 13])
    ids = torch.tensor([1, 2, 3, 4])
    pending = torch.tensor([True, False, True, True])
    rows = torch.tensor([3, 0, 1, 5])
    got = embed_tokens(w, ids, pending, rows, last_tokens)
    want_ids = torch.tensor([29, 2, 22, 13])
    assert torch.equal(got, w[want_ids])
    assert torch.equal(got, embed_tokens_ref(w, ids, pending, rows, last_tokens))


def test_embed_tokens_out_of_range_id_gives_zeros():
    w = _table(10, 16, torch.float32)
    got = embed_tokens(w, torch.tensor([2, 10, -1, 9]))
    assert torch.equal(got[[0, 3]], w[[2, 9]])
    assert not got[[1, 2]].any()


def test_embed_tokens_strided_table_rows_and_no_tokens():
    wide = _table(12, 48, torch.float32)
    w = wide[:, 8:40]  # rows at a stride of 48
    ids = torch.tensor([11, 4])
    assert torch.equal(embed_tokens(w, ids), w[ids])
    assert embed_tokens(w, torch.empty(0, dtype=torch.long)).shape == (0, 32)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(input_ids=torch.tensor([1, 2], dtype=torch.int32)), "input_ids must be"),
        (dict(pending=torch.tensor([True, False])), "go together"),
        (
            dict(
                pending=torch.tensor([1, 0]),
                rows=torch.tensor([0, 1]),
                last_tokens=torch.tensor([3, 4]),
            ),
            "pending must be bool",
        ),
        (
            dict(
                pending=torch.tensor([True, False]),
                rows=torch.tensor([0]),
                last_tokens=torch.tensor([3, 4]),
            ),
            "rows must be int64",
        ),
        (dict(weight=torch.zeros(4, 6).t()), "weight must be"),
        (dict(input_ids=torch.tensor([1, 0, 2, 0])[::2]), "input_ids must be .* contiguous"),
        (
            dict(
                pending=torch.tensor([True, False, False, True])[::2],
                rows=torch.tensor([0, 1]),
                last_tokens=torch.tensor([3, 4]),
            ),
            "pending must be bool",
        ),
    ],
)
def test_embed_tokens_refuses_bad_input(kwargs, match):
    args = dict(weight=torch.zeros(10, 4), input_ids=torch.tensor([1, 2]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        embed_tokens(**args)
