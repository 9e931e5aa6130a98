"""kernels/lora.py's grouped path and kernels/fused_gemv.py's LoRA epilogue under the Triton
interpreter, against torch references written from the definition: one shrink over a fused
projection's stacked A (3 slices, ranks 1, 3, 5 and 6 zero-padded to 6), one expand over its
whole product, slice widths that are not multiples of the tiles, tokens of no adapter (their
rows bit-exact), mixed slots in one batch, the shrink's fused RMSNorm, and the GEMV epilogue
(plain, residual, gated gate/up, 3 slices in one tile). Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_paged.kernels import fused_gemv, fused_gemv_ref, lora_segments
from hf_paged.kernels.fused_gemv import rms_norm_ref
from hf_paged.kernels.lora import (
    LoraEpilogue,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)

RANKS = [[1, 3, 5], [6, 2, 6], [3, 3, 3]]  # per slot, per slice; padded to 6
R = 6


def _group(k, widths, dtype, seed=0):
    """A [S, slices * R, k], B [S, sum(widths), R], scale [slices, S] with each slot's ranks
    per slice, zero beyond them (as hf_paged/lora/slots.py fills them), and the same adapters
    unpadded: {(slot, slice): (A_i, B_i, scale)}."""
    g = torch.Generator().manual_seed(seed)
    n = sum(widths)
    slots = len(RANKS)
    a = torch.zeros(slots, len(widths) * R, k)
    b = torch.zeros(slots, n, R)
    scale = torch.rand(len(widths), slots, generator=g) + 0.25
    adapters = {}
    for slot, ranks in enumerate(RANKS):
        start = 0
        for i, (w, r) in enumerate(zip(widths, ranks)):
            ai = torch.randn(r, k, generator=g) / k**0.5
            bi = torch.randn(w, r, generator=g)
            a[slot, i * R : i * R + r] = ai
            b[slot, start : start + w, :r] = bi
            adapters[slot, i] = (ai.to(dtype), bi.to(dtype), float(scale[i, slot]))
            start += w
    return a.to(dtype), b.to(dtype), scale, adapters


def _by_definition(x, y, adapters, widths, slots):
    """y + (x A_i^T) B_i^T * s_i per token and slice, each adapter at its own rank, float64."""
    out = y.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        start = 0
        for i, w in enumerate(widths):
            ai, bi, sc = adapters[slot, i]
            out[t, start : start + w] += (x[t].double() @ ai.double().T) @ bi.double().T * sc
            start += w
    return out


SLOTS = [2, 2, 2, -1, 0, 1, -1, 1, 0, 2, 2]  # a prefill run, decode rows of each slot, none


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_shrink_and_one_expand_over_three_slices(dtype):
    k, widths = 40, (24, 8, 13)  # q/k/v-like; none a multiple of the expand's tile
    a, b, scale, adapters = _group(k, widths, dtype)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    y = torch.randn(len(slots), sum(widths), generator=g).to(dtype)
    segments = lora_segments(slots, len(RANKS))
    s = lora_shrink(x, a, *segments)
    assert s.shape[-1] == 3 * R
    got = y.clone()
    lora_expand(got, s, b, scale, *segments, slices=widths)
    ref = lora_expand_ref(y, lora_shrink_ref(x, a, slots), b, scale, slots, slices=widths)
    want = _by_definition(x, y, adapters, widths, slots)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.03)
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(ref.double(), want, **tol)
    none = slots < 0
    assert torch.equal(got[none], y[none]) and torch.equal(ref[none], y[none])  # bit-exact
    # each slice's own columns: the same as a one-slice expand with that slice's views
    start = 0
    for i, w in enumerate(widths):
        part = y[:, start : start + w].clone()
        view_a, view_b = a[:, i * R : (i + 1) * R], b[:, start : start + w]
        lora_expand(part, lora_shrink(x, view_a, *segments), view_b, scale[i], *segments)
        torch.testing.assert_close(part, got[:, start : start + w], atol=1e-5, rtol=1e-5)
        start += w


def test_the_shrink_takes_the_norm_weight_and_leaves_the_rms_to_the_gemv():
    k, dtype = 48, torch.bfloat16
    a, _, _, _ = _group(k, (8, 8, 8), dtype)
    slots = torch.tensor([1, -1, 0, 2], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, k, generator=g) * 3).to(dtype)
    w = (torch.rand(k, generator=g) + 0.5).to(dtype)
    segments = lora_segments(slots, len(RANKS))
    inv_rms = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    has = slots >= 0
    for plus_one in (False, True):
        got = lora_shrink(x, a, *segments, norm_weight=w, norm_plus_one=plus_one)
        want = lora_shrink_ref(x, a, slots, norm_weight=w, norm_plus_one=plus_one)
        torch.testing.assert_close(got.sum(0)[has], want[has], atol=2e-2, rtol=2e-2)
        # times each row's 1 / rms: the shrink of the normalised rows (as the GEMV rounds them)
        normed = lora_shrink_ref(rms_norm_ref(x, w, 1e-6, plus_one), a, slots)
        scaled = got.sum(0) * inv_rms[:, None]
        torch.testing.assert_close(scaled[has], normed[has], atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="norm_weight"):
        lora_shrink(x, a, *segments, norm_weight=w.float())


def _epilogue(x, a, b, scale, slots, widths, norm=None):
    segments = lora_segments(slots, a.shape[0])
    kw = {} if norm is None else dict(norm_weight=norm)
    s = lora_shrink(x, a, *segments, **kw)
    return LoraEpilogue(s, b, scale, slots, widths, rms=norm is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_epilogue_adds_each_rows_delta_across_three_slices(dtype):
    k, widths = 64, (20, 6, 6)  # a tile of the interpreter's (32 columns) holds all three
    a, b, scale, adapters = _group(k, widths, dtype, seed=4)
    g = torch.Generator().manual_seed(5)
    slots = torch.tensor([1, -1, 0, 2, 1], dtype=torch.int32)  # mixed slots, one row of none
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    w = (torch.randn(sum(widths), k, generator=g) / 8).to(dtype)
    bias = torch.randn(sum(widths), generator=g).to(dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype)
    lora = _epilogue(x, a, b, scale, slots, widths, norm)
    got = fused_gemv(x, w, norm_weight=norm, eps=1e-5, bias=bias, lora=lora)
    want = fused_gemv_ref(x, w, norm_weight=norm, eps=1e-5, bias=bias, lora=lora)
    base = fused_gemv(x, w, norm_weight=norm, eps=1e-5, bias=bias)
    # from the definition: peft's result + lora_B(lora_A(normed x)) * scale
    normed = rms_norm_ref(x, norm, 1e-5)
    exact = _by_definition(normed, F.linear(normed, w, bias), adapters, widths, slots)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.06, rtol=0.03)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got.double(), exact, **tol)
    assert torch.equal(got[1], base[1])  # the row of no adapter: the base GEMV's bits
    assert not torch.allclose(got[0], base[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_epilogue_gated_and_residual(dtype):
    k, inter = 32, 24
    g = torch.Generator().manual_seed(6)
    slots = torch.tensor([0, 2, -1], dtype=torch.int32)
    x = torch.randn(3, k, generator=g).to(dtype)
    # gate/up: two slices, gate before the activation, up before the product
    a, b, scale, _ = _group(k, (inter, inter), dtype, seed=7)
    gate_up = (torch.randn(2 * inter, k, generator=g) / 6).to(dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype)
    lora = _epilogue(x, a, b, scale, slots, (inter, inter), norm)
    kw = dict(norm_weight=norm, eps=1e-5, up_weight=gate_up[inter:])
    got = fused_gemv(x, gate_up[:inter], lora=lora, **kw)
    want = fused_gemv_ref(x, gate_up[:inter], lora=lora, **kw)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.03, rtol=0.03)
    torch.testing.assert_close(got, want, **tol)
    # the same from the ungated product with the deltas added, then act(gate) * up
    normed = rms_norm_ref(x, norm, 1e-5)
    s = lora_shrink_ref(normed, a, slots)
    gu = lora_expand_ref(F.linear(normed, gate_up), s, b, scale, slots, slices=(inter, inter))
    torch.testing.assert_close(got, F.silu(gu[:, :inter]) * gu[:, inter:], **tol)
    assert torch.equal(got[2], fused_gemv(x, gate_up[:inter], **kw)[2])
    # down: one slice, residual after the delta
    a1, b1, scale1, _ = _group(inter, (k,), dtype, seed=8)
    act = got
    res = torch.randn(3, k, generator=g).to(dtype)
    down = (torch.randn(k, inter, generator=g) / 5).to(dtype)
    lora1 = _epilogue(act, a1[:, :R], b1, scale1, slots, (k,))
    got = fused_gemv(act, down, residual=res, lora=lora1)
    want = fused_gemv_ref(act, down, residual=res, lora=lora1)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[2], fused_gemv(act, down, residual=res)[2])


def test_bad_lora_inputs_are_refused():
    k, widths = 16, (8, 8)
    a, b, scale, _ = _group(k, widths, torch.float32)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    x = torch.randn(2, k)
    w = torch.randn(16, k)
    lora = _epilogue(x, a, b, scale, slots, widths)
    with pytest.raises(ValueError, match="slices"):
        fused_gemv(x, w, lora=LoraEpilogue(lora.s, b, scale, slots, (8, 7)))
    with pytest.raises(ValueError, match="slots"):
        fused_gemv(x, w, lora=LoraEpilogue(lora.s, b, scale, slots.long(), widths))
    with pytest.raises(ValueError, match="do not fit"):  # gated: B must hold gate and up rows
        fused_gemv(x, w, up_weight=w, lora=lora)
    with pytest.raises(ValueError, match="needs norm_weight"):  # x * g, and no rms to take
        fused_gemv(x, w, lora=LoraEpilogue(lora.s, b, scale, slots, widths, rms=True))
    y = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="slices"):
        lora_expand(y, lora.s, b, scale, *lora_segments(slots, 3), slices=(4, 4, 4, 4))
    with pytest.raises(ValueError, match="scale"):
        lora_expand(y, lora.s, b, scale[0], *lora_segments(slots, 3), slices=widths)
