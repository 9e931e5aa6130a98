"""kernels/lora.py under the Triton interpreter: shrink and expand against their torch refs and
against a per-token loop written from the definition, with tokens of no adapter (rows untouched),
ranks 1, 3, 8 and 12 zero-padded in one stack, split-K partial sums, segments built on the device
and on the host, and refusals of bad inputs. Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_paged.kernels import (
    lora_expand,
    lora_expand_ref,
    lora_segments,
    lora_shrink,
    lora_shrink_ref,
)

from hf_paged.lora.batch import lora_segments_host

RANKS = [1, 3, 8, 12]  # one adapter per slot; the stack is padded to 12
MAX_RANK = 12


def _stacks(k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(len(RANKS), MAX_RANK, k)
    b = torch.zeros(len(RANKS), n, MAX_RANK)
    for slot, r in enumerate(RANKS):
        a[slot, :r] = torch.randn(r, k, generator=g)
        b[slot, :, :r] = torch.randn(n, r, generator=g)
    scale = torch.tensor([2.0, 0.5, 1.0, 0.25])
    return a.to(dtype), b.to(dtype), scale


def _by_definition(x, y, a, b, scale, slots):
    """y[t] + (x[t] @ A_t^T) @ B_t^T * s_t with each adapter at its own rank, in float64."""
    out = y.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        r = RANKS[slot]
        h = x[t].double() @ a[slot, :r].double().T
        out[t] += (h @ b[slot, :, :r].double().T) * scale[slot].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_expand_match_the_definition_and_the_refs(dtype):
    k, n = 40, 24  # neither a multiple of the tiles
    a, b, scale = _stacks(k, n, dtype)
    # a prefill run of slot 2, decode rows of every slot, tokens of no adapter in between
    slots = torch.tensor([2, 2, 2, 2, 2, -1, 0, 3, -1, 1, 3, 0, 2, -1], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    y = torch.randn(len(slots), n, generator=g).to(dtype)
    sorted_tokens, slot_start = lora_segments(slots, len(RANKS))
    s = lora_shrink(x, a, sorted_tokens, slot_start)
    got = y.clone()
    lora_expand(got, s, b, scale, sorted_tokens, slot_start)
    want = _by_definition(x, y, a, b, scale, slots)
    ref = lora_expand_ref(y, lora_shrink_ref(x, a, slots), b, scale, slots)
    none = slots < 0
    assert torch.equal(got[none], y[none])  # no adapter: the row is not touched
    assert torch.equal(ref[none], y[none])
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.3, rtol=0.05)
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(ref.double(), want, **tol)
    mine = ~none
    assert torch.allclose(s.sum(0)[mine], lora_shrink_ref(x, a, slots)[mine], atol=1e-3, rtol=1e-2)


def test_split_k_partial_sums_add_up():
    k, n = 96, 16
    a, b, scale = _stacks(k, n, torch.float32, seed=2)
    slots = torch.tensor([3, 1, -1, 0, 2], dtype=torch.int32)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    y = torch.zeros(5, n)
    sorted_tokens, slot_start = lora_segments(slots, len(RANKS))
    one = lora_shrink(x, a, sorted_tokens, slot_start, split_k=1)
    three = lora_shrink(x, a, sorted_tokens, slot_start, split_k=3)
    assert one.shape[0] == 1 and three.shape[0] == 2  # 96 = 2 blocks of 64: no empty split
    mine = slots >= 0
    torch.testing.assert_close(three.sum(0)[mine], one[0][mine], atol=1e-5, rtol=1e-5)
    out1, out3 = y.clone(), y.clone()
    lora_expand(out1, one, b, scale, sorted_tokens, slot_start)
    lora_expand(out3, three, b, scale, sorted_tokens, slot_start)
    torch.testing.assert_close(out3, out1, atol=1e-5, rtol=1e-5)
    assert not out1[2].any()


def test_segments_on_the_device_and_the_host_agree():
    slots = np.array([3, -1, 0, 3, 3, -1, 1, 0], dtype=np.int64)
    dev_sorted, dev_start = lora_segments(torch.from_numpy(slots), 5)
    host_sorted, host_start = lora_segments_host(slots, 5)
    assert dev_sorted.tolist() == host_sorted.tolist() == [2, 7, 6, 0, 3, 4, 1, 5]
    assert dev_start.tolist() == host_start.tolist() == [0, 2, 3, 3, 6, 6]


@pytest.mark.parametrize("t", [1, 2, 3, 5, 6, 7])
def test_a_steps_lora_batch_parts_start_on_16_byte_boundaries(t):
    # Triton specialises on pointer alignment: any other start would compile kernel variants
    # by the step's token count
    from hf_paged.lora.batch import lora_batch

    slots = np.random.default_rng(t).integers(-1, 4, t).astype(np.int32)
    batch = lora_batch(slots, 4, torch.device("cpu"))
    parts = (batch.token_slots, batch.sorted_tokens, batch.slot_start)
    assert all(p.data_ptr() % 16 == 0 for p in parts)
    host_sorted, host_start = lora_segments_host(slots, 4)
    assert batch.token_slots.tolist() == slots.tolist()
    assert batch.sorted_tokens.tolist() == host_sorted.tolist()
    assert batch.slot_start.tolist() == host_start.tolist()


def test_no_token_with_an_adapter_changes_nothing():
    a, b, scale = _stacks(16, 16, torch.float32)
    slots = torch.full((3,), -1, dtype=torch.int32)
    x, y = torch.randn(3, 16), torch.randn(3, 16)
    sorted_tokens, slot_start = lora_segments(slots, len(RANKS))
    got = y.clone()
    lora_expand(
        got, lora_shrink(x, a, sorted_tokens, slot_start), b, scale, *(sorted_tokens, slot_start)
    )
    assert torch.equal(got, y)


def test_bad_inputs_are_refused():
    a, b, scale = _stacks(16, 8, torch.float32)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    st, ss = lora_segments(slots, len(RANKS))
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="a_stack"):
        lora_shrink(x, a[:, :, :8], st, ss)
    with pytest.raises(ValueError, match="sorted_tokens"):
        lora_shrink(x, a, st.long(), ss)
    with pytest.raises(ValueError, match="slot_start"):
        lora_shrink(x, a, st, ss[:-1])
    s = lora_shrink(x, a, st, ss)
    with pytest.raises(ValueError, match="b_stack"):
        lora_expand(torch.zeros(2, 9), s, b, scale, st, ss)
    with pytest.raises(ValueError, match="scale"):
        lora_expand(torch.zeros(2, 8), s, b, scale.double(), st, ss)
    with pytest.raises(ValueError, match="s must be"):
        lora_expand(torch.zeros(2, 8), s.half(), b, scale, st, ss)


def test_many_tokens_take_the_wide_tiles():
    # more than 256 tokens: 64-token tiles (and 8 warps in expand), runs of every slot
    a, b, scale = _stacks(16, 24, torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    slots = torch.randint(-1, len(RANKS), (300,), generator=g).to(torch.int32)
    x, y = torch.randn(300, 16, generator=g), torch.randn(300, 24, generator=g)
    sorted_tokens, slot_start = lora_segments(slots, len(RANKS))
    got = y.clone()
    lora_expand(
        got, lora_shrink(x, a, sorted_tokens, slot_start), b, scale, sorted_tokens, slot_start
    )
    torch.testing.assert_close(
        got.double(), _by_definition(x, y, a, b, scale, slots), atol=1e-4, rtol=1e-4
    )
