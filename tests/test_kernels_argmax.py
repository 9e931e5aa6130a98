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


def test_argmax_rows_signed_zeros_and_negative_rows(small_chunks):
    # -0.0 equals +0.0 (the first of them wins), negative maxima, a negative NaN (still NaN:
    # the maximum), subnormals above zero
    x = torch.full((4, 40), -5.0)
    x[0, 30], x[0, 7] = 0.0, -0.0  # equal maxima: index 7
    x[1, 12], x[1, 36] = -1.5, -1.25  # the less negative: 36
    x[2, 20] = -float("nan")
    x[2, 2] = float("inf")
    x[3, 9], x[3, 31] = 1e-45, 0.0
    want = x.argmax(dim=-1)
    assert want.tolist() == [7, 36, 20, 9]  # what torch does, so the test means it
    assert torch.equal(argmax_rows(x), want)


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


@pytest.mark.parametrize("chunked", [False, True])
def test_argmax_rows_scatters_tokens_into_rows(chunked, request):
    # dst[rows[i]] = token i in the same launch (the decode graph's last_tokens); every other
    # entry of dst, and the returned tokens, as without scatter
    if chunked:
        request.getfixturevalue("small_chunks")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 61, generator=g)
    want = x.argmax(dim=-1)
    dst = torch.full((9,), -5, dtype=torch.int64)
    rows = torch.tensor([6, 0, 8, 3])
    got = argmax_rows(x, scatter=(dst, rows))
    assert torch.equal(got, want)
    expect = torch.full((9,), -5, dtype=torch.int64)
    expect[rows] = want
    assert torch.equal(dst, expect)


def test_argmax_rows_scatter_skips_padding_rows():
    # a padded graph batch: rows -1 (and any row outside dst) write nothing, so they cannot
    # overwrite a real row's token, whatever order the programs run in
    x = torch.zeros(5, 20)
    x[torch.arange(5), torch.tensor([11, 4, 17, 9, 2])] = 1.0
    dst = torch.arange(100, 106)
    rows = torch.tensor([2, 0, -1, -1, 6])  # 6: one past the end of dst
    got = argmax_rows(x, scatter=(dst, rows))
    assert got.tolist() == [11, 4, 17, 9, 2]
    assert dst.tolist() == [4, 101, 11, 103, 104, 105]


def test_argmax_rows_scatter_strided_rows_and_no_rows():
    wide = torch.randn(6, 90, generator=torch.Generator().manual_seed(3))
    x = wide[::2, 5:80]
    dst = torch.zeros(3, dtype=torch.int64)
    argmax_rows(x, scatter=(dst, torch.tensor([2, 1, 0])))
    assert dst.tolist() == x.argmax(dim=-1).flip(0).tolist()
    untouched = torch.zeros(3, dtype=torch.int64)
    argmax_rows(torch.empty(0, 10), scatter=(untouched, torch.empty(0, dtype=torch.int64)))
    assert not untouched.any()


def test_argmax_rows_pdl_off_the_gpu_is_a_plain_launch():
    # pdl=True where programmatic dependent launch is unavailable (CPU, the interpreter):
    # launched as usual, same answer
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    dst = torch.zeros(3, dtype=torch.int64)
    assert torch.equal(argmax_rows(x, scatter=(dst, torch.arange(3)), pdl=True), x.argmax(-1))
    assert torch.equal(dst, x.argmax(-1))


_X = torch.randn(3, 10)
_I = torch.zeros(3, dtype=torch.int64)


@pytest.mark.parametrize(
    ("scatter", "match"),
    [
        ((torch.zeros(4, dtype=torch.int32), _I), r"dst must be int64 1-d, got torch.int32"),
        ((torch.zeros(2, 4, dtype=torch.int64), _I), r"dst must be int64 1-d"),
        ((torch.zeros(8, dtype=torch.int64)[::2], _I), "dst must be contiguous"),
        ((torch.zeros(4, dtype=torch.int64), _I[:2]), r"rows must be int64 \[3\], got .* \[2\]"),
        ((torch.zeros(4, dtype=torch.int64), _I.int()), r"rows must be int64 \[3\]"),
        ((torch.zeros(4, dtype=torch.int64), [0, 1, 2]), "rows must be a tensor"),
        ((torch.zeros(4, dtype=torch.int64),), r"scatter must be a pair \(dst, rows\)"),
    ],
)
def test_argmax_rows_refuses_bad_scatter(scatter, match):
    dst = scatter[0]
    before = dst.clone()
    with pytest.raises(ValueError, match=match):
        argmax_rows(_X, scatter=scatter)
    assert torch.equal(dst, before)


def test_argmax_rows_lands_tokens_in_the_host_slot():
    # host=(buf, slot): buf[slot, i] = token i (the decode graph's pinned landing rows; here a
    # CPU tensor under the interpreter), the other slot and the entries past the rows untouched
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(9))
    want = x.argmax(dim=-1)
    for slot in (1, 0):
        buf = torch.full((2, 5), -7, dtype=torch.int64)
        got = argmax_rows(x, host=(buf, torch.tensor([slot])))
        assert torch.equal(got, want)
        assert buf[slot, :3].tolist() == want.tolist() and (buf[slot, 3:] == -7).all()
        assert (buf[1 - slot] == -7).all()
    # with a scatter too, both land, except for padding rows (-1): nothing on the host either
    buf, dst = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    argmax_rows(x, scatter=(dst, torch.tensor([3, -1, 0])), host=(buf, torch.tensor([1])))
    assert buf[1].tolist() == [want[0], 0, want[2]] and dst.tolist() == [want[2], 0, 0, want[0]]


_SLOT = torch.zeros(1, dtype=torch.int64)


@pytest.mark.parametrize(
    ("host", "match"),
    [
        ((torch.zeros(2, 3, dtype=torch.int32), _SLOT), "host buf must be an int64"),
        ((torch.zeros(6, dtype=torch.int64), _SLOT), "host buf must be an int64"),
        ((torch.zeros(2, 2, dtype=torch.int64), _SLOT), "host buf must hold 3 contiguous"),
        ((torch.zeros(2, 3, dtype=torch.int64), _SLOT.int()), r"slot must be int64 \[1\]"),
        ((torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)), "slot"),
        ((torch.zeros(2, 3, dtype=torch.int64),), r"host must be a pair \(buf, slot\)"),
    ],
)
def test_argmax_rows_refuses_bad_host(host, match):
    with pytest.raises(ValueError, match=match):
        argmax_rows(_X, host=host)


def _advance(m=3, width=4, page=4):
    """A DecodeAdvance for m rows: positions 5, 7, 11 in tables of `width` blocks of `page`."""
    pos = torch.tensor([5, 7, 11][:m], dtype=torch.int64)
    table = torch.arange(m * width, dtype=torch.int32).reshape(m, width) + 100
    return am.DecodeAdvance(
        positions=pos.clone(),
        seq_lens=(pos + 1).int(),
        slot_mapping=torch.zeros(m, dtype=torch.int64),
        block_table=table,
        sent_positions=pos.clone(),
        page_size=page,
    )


def test_argmax_rows_advance_moves_real_rows_on_a_token():
    # advance: each real row's next decode inputs (position + 1, sequence length + 1, the cache
    # slot from its table at the new position); graph padding (rows -1) keeps its own; the
    # landing row alternates with every step since the host's last copy
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    want = x.argmax(dim=-1)
    adv = _advance()
    dst, buf = torch.zeros(8, dtype=torch.int64), torch.full((2, 3), -7, dtype=torch.int64)
    rows = torch.tensor([2, -1, 6])
    argmax_rows(x, scatter=(dst, rows), host=(buf, torch.tensor([1])), advance=adv)
    assert adv.positions.tolist() == [6, 7, 12] and adv.seq_lens.tolist() == [7, 8, 13]
    # row 0: position 6 is block 1 of its table (101), offset 2; row 2: 12 -> block 3 (111), 0
    assert adv.slot_mapping.tolist() == [101 * 4 + 2, 0, 111 * 4 + 0]
    assert buf[1].tolist() == [want[0], -7, want[2]] and (buf[0] == -7).all()
    # the next step, not sent: one position past what the host sent, so the other landing row
    argmax_rows(x, scatter=(dst, rows), host=(buf, torch.tensor([1])), advance=adv)
    assert adv.positions.tolist() == [7, 7, 13]
    assert buf[0].tolist() == [want[0], -7, want[2]]


def test_argmax_rows_advance_sets_the_real_rows_input_tokens():
    # advance.input_ids: each real row's input token becomes the token drawn (a row that fed a
    # token from the host feeds the drawn one next); padding keeps its own
    import dataclasses

    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([40, 41, 42])
    adv = dataclasses.replace(_advance(), input_ids=ids)
    dst, buf = torch.zeros(8, dtype=torch.int64), torch.zeros((2, 3), dtype=torch.int64)
    argmax_rows(
        x, scatter=(dst, torch.tensor([2, -1, 6])), host=(buf, torch.tensor([0])), advance=adv
    )
    want = x.argmax(dim=-1)
    assert ids.tolist() == [want[0], 41, want[2]]
    with pytest.raises(ValueError, match=r"advance.input_ids must be int64 \[3\]"):
        bad = dataclasses.replace(_advance(), input_ids=ids.int())
        argmax_rows(
            x, scatter=(dst, torch.tensor([2, -1, 6])), host=(buf, torch.tensor([0])), advance=bad
        )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(seq_lens=torch.zeros(3, dtype=torch.int64)), r"advance.seq_lens must be int32"),
        (dict(block_table=torch.zeros(3, 4, dtype=torch.int64)), "advance.block_table"),
        (dict(block_table=torch.zeros(3, 0, dtype=torch.int32)), "advance.block_table"),
        (dict(positions=torch.zeros(2, dtype=torch.int64)), r"advance.positions must be int64"),
        (dict(slot_mapping=torch.zeros(3, dtype=torch.int32)), "advance.slot_mapping"),
        (dict(page_size=0), "advance.page_size"),
    ],
)
def test_argmax_rows_refuses_bad_advance(change, match):
    import dataclasses

    adv = dataclasses.replace(_advance(), **change)
    scatter = (torch.zeros(8, dtype=torch.int64), _I)
    host = (torch.zeros(2, 3, dtype=torch.int64), _SLOT)
    with pytest.raises(ValueError, match=match):
        argmax_rows(_X, scatter=scatter, host=host, advance=adv)
    with pytest.raises(ValueError, match="advance needs scatter"):
        argmax_rows(_X, host=host, advance=_advance())
    with pytest.raises(ValueError, match="advance must be a DecodeAdvance"):
        argmax_rows(_X, scatter=scatter, host=host, advance=(1, 2))


@pytest.mark.parametrize("vocab", [33, 70, 200])
@pytest.mark.parametrize("chunked", [False, True])
def test_argmax_rows_allowed_matches_xgrammars_mask(vocab, chunked, request):
    """allowed=(bitmask, rows): the argmax of the logits xgrammar's own mask leaves (its CPU
    apply_token_bitmask_inplace, the layout's definition), for every row or flagged rows only,
    with a row that allows nothing (0, as for a row of -inf) and bf16 logits."""
    xgr = pytest.importorskip("xgrammar")
    if chunked:
        request.getfixturevalue("small_chunks")
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    bits = torch.randint(-(2**31), 2**31 - 1, (6, (vocab + 31) // 32), generator=g)
    bits = bits.to(torch.int32)
    bits[2] = 0
    bits[4] &= 0x00100010  # a few tokens
    on = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.int32)
    for indices, flags in ((None, None), ([0, 2, 3, 5], on)):
        ref = x.clone()
        xgr.apply_token_bitmask_inplace(ref, bits, vocab_size=vocab, indices=indices)
        want = ref.argmax(dim=-1)
        assert not torch.equal(want, x.argmax(dim=-1))  # the mask changes the answer
        assert torch.equal(argmax_rows(x, allowed=(bits, flags)), want)
        ref16 = x.bfloat16()
        xgr.apply_token_bitmask_inplace(ref16, bits, vocab_size=vocab, indices=indices)
        assert torch.equal(argmax_rows(x.bfloat16(), allowed=(bits, flags)), ref16.argmax(-1))
    assert argmax_rows(x, allowed=(bits, None))[2].item() == 0


def test_argmax_rows_allowed_refuses_bad_bitmasks():
    x = torch.randn(3, 70)
    good = torch.zeros(3, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="allowed bitmask must be an int32"):
        argmax_rows(x, allowed=(good.long(), None))
    with pytest.raises(ValueError, match=r"allowed bitmask must be \[3, >= 3\]"):
        argmax_rows(x, allowed=(good[:, :2], None))
    with pytest.raises(ValueError, match="allowed rows must be int32"):
        argmax_rows(x, allowed=(good, torch.ones(2, dtype=torch.int32)))
    with pytest.raises(ValueError, match="allowed must be a pair"):
        argmax_rows(x, allowed=good)
