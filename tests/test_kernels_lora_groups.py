"""kernels/lora.py's grouped path and kernels/fused_gemv.py's LoRA epilogue under the Triton
interpreter, against torch references written from the definition: one shrink over a fused
projection's stacked A (3 slices, ranks 1, 3, 5 and 6 zero-padded to 6), one expand over its
whole product, slice widths that are not multiples of the tiles, tokens of no adapter (their
rows bit-exact), mixed slots in one batch, the small-batch shrink (its fused RMSNorm weight) and
the GEMV epilogue (plain, residual, gated gate/up, 3 slices in one tile) fed by either shrink.
Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_paged.kernels import fused_gemv, fused_gemv_ref, lora_segments
from hf_paged.kernels.fused_gemv import rms_norm_ref
from hf_paged.kernels.host_math import next_power_of_2
from hf_paged.kernels.lora import (
    LoraEpilogue,
    lora_expand,
    lora_expand_folded,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
    own_slot_columns,
)
from hf_paged.kernels.lora_epilogue import lora_rows_shrink, rows_shrink_tiles

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


def _extended(x, w, a):
    """x @ [W; A_0; ...; A_S-1]^T: the folded projection's product (hf_paged/lora/fold.py)."""
    return F.linear(x, torch.cat([w, a.reshape(-1, a.shape[-1])]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_expand_reads_each_tokens_slot_out_of_the_extended_product(dtype):
    k, widths = 40, (24, 8, 13)
    n = sum(widths)
    a, b, scale, adapters = _group(k, widths, dtype)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    full = _extended(x, w, a)
    y, s_all = full[:, :n], full[:, n:]  # strided views, as the engine hands them over
    base = y.clone()
    lora_expand_folded(y, s_all, b, scale, *lora_segments(slots, len(RANKS)), slices=widths)
    own = own_slot_columns(s_all, slots, 3 * R)
    ref = lora_expand_ref(base, own, b, scale, slots, slices=widths)
    want = _by_definition(x, base, adapters, widths, slots)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.03)
    torch.testing.assert_close(y.double(), want, **tol)
    torch.testing.assert_close(ref.double(), want, **tol)
    none = slots < 0
    assert torch.equal(y[none], base[none]) and not own[none].any()
    assert torch.equal(full[:, n:], s_all)  # the shrink's columns are read, not written
    # the separate shrink's expand on the same rounded shrink: the same sums
    s = torch.where(none[:, None], 0.0, own)[None]
    separate = base.clone()
    lora_expand(separate, s, b, scale, *lora_segments(slots, len(RANKS)), slices=widths)
    torch.testing.assert_close(separate, y, atol=1e-5, rtol=1e-5)


def test_bad_folded_expand_inputs_are_refused():
    k, widths = 16, (8, 8)
    a, b, scale, _ = _group(k, widths, torch.float32)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    full = _extended(torch.randn(2, k), torch.randn(16, k), a)
    seg = lora_segments(slots, 3)
    with pytest.raises(ValueError, match="s_all"):  # one slot's columns short
        lora_expand_folded(full[:, :16], full[:, 16:-1], b, scale, *seg, slices=widths)
    with pytest.raises(ValueError, match="s_all"):  # another dtype than the product's
        lora_expand_folded(full[:, :16], full[:, 16:].double(), b, scale, *seg, slices=widths)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_rows_shrink_reads_each_rows_slot_and_splits_the_inputs(m):
    # the small-batch forward's shrink: no grouping by slot, A's tile of row 0 before the PDL
    # wait, partial sums over the input dimension (k 1100: 3 splits of 512 at rank 18)
    k, dtype = 1100, torch.bfloat16
    a, _, _, _ = _group(k, (8, 8, 8), dtype)
    assert rows_shrink_tiles(k, a.shape[1])[1] == 512
    slots = torch.tensor([2, -1, 0, 1, 1, -1, 2, 0][:m], dtype=torch.int32)
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = (torch.rand(k, generator=g) + 0.5).to(dtype)
    has = slots >= 0
    inv_rms = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    for kw in ({}, dict(norm_weight=w), dict(norm_weight=w, norm_plus_one=True)):
        got = lora_rows_shrink(x, a, slots, **kw)
        assert got.shape == (3, m, 3 * R)
        want = lora_shrink_ref(x, a, slots, **kw)
        torch.testing.assert_close(got.sum(0)[has], want[has], atol=2e-2, rtol=2e-2)
        assert torch.isfinite(got).all()  # rows of no adapter are written too (slot 0's)
        if kw:  # x * g: times each row's 1 / rms, the shrink of the normalised rows
            normed = rms_norm_ref(x, w, 1e-6, kw.get("norm_plus_one", False))
            want = lora_shrink_ref(normed, a, slots)
            scaled = got.sum(0) * inv_rms[:, None]
            torch.testing.assert_close(scaled[has], want[has], atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="slots"):
        lora_rows_shrink(x, a, slots.long())
    with pytest.raises(ValueError, match="norm_weight"):
        lora_rows_shrink(x, a, slots, norm_weight=w.float())


def test_rows_shrink_tiles_bound_the_epilogues_reads():
    for k in (2048, 4096, 5632, 14336):
        for sr in (16, 32, 48, 96, 192):
            c_tile, k_per = rows_shrink_tiles(k, sr)
            split = -(-k // k_per)
            assert c_tile * k_per <= 8192 and c_tile >= 1
            assert triton_pow2(split) * triton_pow2(sr) <= 2048, (k, sr)


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


SHRINKS = ["grouped", "rows"]  # lora_shrink (split_k as given), lora_rows_shrink


def _epilogue(x, a, b, scale, slots, widths, norm=None, split_k=None, shrink="grouped"):
    kw = {} if norm is None else dict(norm_weight=norm)
    if shrink == "rows":
        s = lora_rows_shrink(x, a, slots, **kw)
    else:  # x * g by hand (as lora_rows_shrink's norm_weight), in split_k partial sums
        xg = x if norm is None else (x.float() * norm.float()).to(x.dtype)
        s = lora_shrink(xg, a, *lora_segments(slots, a.shape[0]), split_k=split_k)
    return LoraEpilogue(s, b, scale, slots, widths, rms=norm is not None)


def _row_serial(x, w, **kw):
    """fused_gemv without LoRA on the kernel the LoRA epilogue runs in, with the interpreter's
    tile: without it, calls of more than ROW_SERIAL_ROWS rows go to the tensor-core kernel,
    whose sums come in another order (so not the same float32 bits)"""
    block_n = min(64, next_power_of_2(w.shape[0]))
    return fused_gemv(x, w, config=dict(BLOCK_N=block_n, num_warps=4), **kw)


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_epilogue_adds_each_rows_delta_across_three_slices(dtype, shrink):
    k, widths = 200, (20, 6, 6)  # a tile of the interpreter's (32 columns) holds all three
    a, b, scale, adapters = _group(k, widths, dtype, seed=4)
    g = torch.Generator().manual_seed(5)
    slots = torch.tensor([1, -1, 0, 2, 1], dtype=torch.int32)  # mixed slots, one row of none
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    w = (torch.randn(sum(widths), k, generator=g) / 8).to(dtype)
    bias = torch.randn(sum(widths), generator=g).to(dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype)
    lora = _epilogue(x, a, b, scale, slots, widths, norm, split_k=3, shrink=shrink)
    if shrink == "grouped":
        assert lora.s.shape[0] == 2  # partial sums the epilogue adds up
    got = fused_gemv(x, w, norm_weight=norm, eps=1e-5, bias=bias, lora=lora)
    want = fused_gemv_ref(x, w, norm_weight=norm, eps=1e-5, bias=bias, lora=lora)
    base = _row_serial(x, w, norm_weight=norm, eps=1e-5, bias=bias)
    # from the definition: peft's result + lora_B(lora_A(normed x)) * scale
    normed = rms_norm_ref(x, norm, 1e-5)
    exact = _by_definition(normed, F.linear(normed, w, bias), adapters, widths, slots)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.06, rtol=0.03)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got.double(), exact, **tol)
    assert torch.equal(got[1], base[1])  # the row of no adapter: the base GEMV's bits
    assert not torch.allclose(got[0], base[0])


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_epilogue_gated_and_residual(dtype, shrink):
    k, inter = 32, 24
    g = torch.Generator().manual_seed(6)
    slots = torch.tensor([0, 2, -1], dtype=torch.int32)
    x = torch.randn(3, k, generator=g).to(dtype)
    # gate/up: two slices, gate before the activation, up before the product
    a, b, scale, _ = _group(k, (inter, inter), dtype, seed=7)
    gate_up = (torch.randn(2 * inter, k, generator=g) / 6).to(dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype)
    lora = _epilogue(x, a, b, scale, slots, (inter, inter), norm, shrink=shrink)
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
    assert torch.equal(got[2], _row_serial(x, gate_up[:inter], **kw)[2])
    # down: one slice, residual after the delta
    a1, b1, scale1, _ = _group(inter, (k,), dtype, seed=8)
    act = got
    res = torch.randn(3, k, generator=g).to(dtype)
    down = (torch.randn(k, inter, generator=g) / 5).to(dtype)
    lora1 = _epilogue(act, a1[:, :R].contiguous(), b1, scale1, slots, (k,), shrink=shrink)
    got = fused_gemv(act, down, residual=res, lora=lora1)
    want = fused_gemv_ref(act, down, residual=res, lora=lora1)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[2], _row_serial(act, down, residual=res)[2])


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_qkv_rope_adds_the_qkv_deltas_before_rope(dtype, bias, shrink):
    from hf_paged.kernels import norm_qkv_rope, norm_qkv_rope_ref

    g = torch.Generator().manual_seed(12)
    hq, hkv, d, k = 4, 2, 16, 200
    widths = (hq * d, hkv * d, hkv * d)
    n = sum(widths)
    a, b, scale, _ = _group(k, widths, dtype, seed=13)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)  # mixed, one row of no adapter
    x = torch.randn(3, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    bias_ = torch.randn(n, generator=g).to(dtype) if bias else None
    nw = (torch.rand(k, generator=g) + 0.5).to(dtype)
    angles = torch.randn(50, d // 2, generator=g)
    args = (torch.randint(0, 50, (3,), generator=g), angles.cos().to(dtype), angles.sin().to(dtype))
    cache_slots = torch.tensor([5, 2, 9])
    caches = [torch.zeros(4, 4, hkv, d, dtype=dtype) for _ in range(6)]
    lora = _epilogue(x, a, b, scale, slots, widths, nw, split_k=3, shrink=shrink)
    q = norm_qkv_rope(x, w, bias_, nw, 1e-5, *args, *caches[:2], cache_slots, hq, lora=lora)
    q_ref = norm_qkv_rope_ref(
        x, w, bias_, nw, 1e-5, *args, *caches[2:4], cache_slots, hq, lora=lora
    )
    q_base = norm_qkv_rope(x, w, bias_, nw, 1e-5, *args, *caches[4:], cache_slots, hq)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)  # keys: deltas, then rotated
    torch.testing.assert_close(caches[1], caches[3], **tol)  # values
    assert torch.equal(q[1], q_base[1])  # no adapter: the base kernel's bits
    block, off = 2 // 4, 2 % 4  # row 1's cache slot
    assert torch.equal(caches[0][block, off], caches[4][block, off])
    assert not torch.allclose(q[0], q_base[0]) and not torch.allclose(caches[1], caches[5])
    with pytest.raises(ValueError, match="slices must be q/k/v"):
        bad = LoraEpilogue(lora.s, b, scale, slots, widths, rms=False)
        norm_qkv_rope(x, w, bias_, nw, 1e-5, *args, *caches[:2], cache_slots, hq, lora=bad)


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


# --- real shapes on a CUDA GPU (`pytest -m gpu tests/test_kernels_lora_groups.py`) ---

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# TinyLlama-1.1B and Llama-3-8B: hidden, q/k/v widths, intermediate
SHAPES = {"1.1b": (2048, (2048, 256, 256), 5632), "8b": (4096, (4096, 1024, 1024), 14336)}
SLOTS_GPU, RANK = 8, 16


def _cuda_group(k, widths, g, pad_slot=3, pad_from=12):
    """bf16 group buffers of 8 slots at rank 16; one slot's adapter of rank 12, zero-padded."""
    n = len(widths)
    a = torch.randn(SLOTS_GPU, n * RANK, k, generator=g, device="cuda") / k**0.5
    b = torch.randn(SLOTS_GPU, sum(widths), RANK, generator=g, device="cuda") / RANK**0.5
    for i in range(n):
        a[pad_slot, i * RANK + pad_from : (i + 1) * RANK] = 0
    b[pad_slot, :, pad_from:] = 0
    scale = torch.rand(n, SLOTS_GPU, generator=g, device="cuda") + 0.5
    return a.bfloat16(), b.bfloat16(), scale


def _cuda_slots(t, g):
    """Decode rows of every slot and of none; from 64 tokens on, prefill runs of one slot."""
    if t < 64:
        return torch.randint(-2, SLOTS_GPU, (t,), generator=g, device="cuda").clamp(min=-1).int()
    runs = torch.arange(t, device="cuda") * 5 // t
    return torch.tensor([3, 0, -1, 7, 5], device="cuda")[runs].int()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [1, 3, 8, 64, 300])
@pytest.mark.parametrize("group", ["qkv", "gate_up"])
def test_gpu_grouped_shrink_expand_real_shapes(shape, t, group):
    hidden, qkv, inter = SHAPES[shape]
    widths = qkv if group == "qkv" else (inter, inter)
    g = torch.Generator(device="cuda").manual_seed(t)
    a, b, scale = _cuda_group(hidden, widths, g)
    slots = _cuda_slots(t, g)
    x = torch.randn(t, hidden, generator=g, device="cuda").bfloat16()
    y = torch.randn(t, sum(widths), generator=g, device="cuda").bfloat16()
    seg = lora_segments(slots, SLOTS_GPU)
    s = lora_shrink(x, a, *seg)
    got = y.clone()
    lora_expand(got, s, b, scale, *seg, slices=widths)
    torch.cuda.synchronize()
    mine = slots >= 0
    ref_s = lora_shrink_ref(x.float(), a.float(), slots)
    torch.testing.assert_close(s.sum(0)[mine], ref_s[mine], atol=2e-2, rtol=2e-2)
    want = lora_expand_ref(
        y.float(), ref_s.bfloat16().float(), b.float(), scale, slots, slices=widths
    )
    assert torch.equal(got[~mine], y[~mine])  # no adapter: untouched, bit for bit
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=2e-2)
    # the same bits as one shrink + expand per slice through the slices' views
    start = 0
    for i, w in enumerate(widths):
        part = y[:, start : start + w].contiguous()
        view_a = a[:, i * RANK : (i + 1) * RANK]
        lora_expand(part, lora_shrink(x, view_a, *seg), b[:, start : start + w], scale[i], *seg)
        torch.testing.assert_close(part, got[:, start : start + w], atol=2e-2, rtol=1e-2)
        start += w


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [3, 64, 300, 2048])
@pytest.mark.parametrize("group", ["qkv", "gate_up"])
def test_gpu_folded_expand_real_shapes(shape, t, group):
    hidden, qkv, inter = SHAPES[shape]
    widths = qkv if group == "qkv" else (inter, inter)
    n = sum(widths)
    g = torch.Generator(device="cuda").manual_seed(t)
    a, b, scale = _cuda_group(hidden, widths, g)
    slots = _cuda_slots(t, g)
    x = torch.randn(t, hidden, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, hidden, generator=g, device="cuda") / hidden**0.5).bfloat16()
    full = _extended(x, w, a)
    base = full[:, :n].clone()
    y, s_all = full[:, :n], full[:, n:]
    lora_expand_folded(y, s_all, b, scale, *lora_segments(slots, SLOTS_GPU), slices=widths)
    torch.cuda.synchronize()
    mine = slots >= 0
    own = own_slot_columns(s_all, slots, len(widths) * RANK)
    want = lora_expand_ref(base.float(), own, b.float(), scale, slots, slices=widths)
    assert torch.equal(y[~mine], base[~mine]) and not y.isnan().any()
    torch.testing.assert_close(y.float(), want, atol=5e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_gemv_epilogue_real_shapes(shape, rows, pdl):
    """A decoder layer's four GEMVs with their LoRA epilogues at real shapes (q/k/v and gate/up
    after one normalising shrink each, o and down after a plain one), bf16, against
    fused_gemv_ref; rows of no adapter bit-exact with the GEMV without LoRA."""
    from hf_paged.kernels.fused_gemv import pdl_available

    if pdl and not pdl_available(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90")
    hidden, qkv, inter = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(rows)
    slots = torch.tensor([0, -1, 3, 7, 2, 5, -1, 1][:rows], dtype=torch.int32, device="cuda")
    h = torch.randn(rows, hidden, generator=g, device="cuda").bfloat16()
    norm = (torch.rand(hidden, generator=g, device="cuda") + 0.5).bfloat16()

    def weight(n, k):
        return (torch.randn(n, k, generator=g, device="cuda") / k**0.5).bfloat16()

    def check(x, w, widths, normed, tol=(6e-2, 3e-2), **kw):
        a, b, scale = _cuda_group(x.shape[1], widths, g)
        nkw = dict(norm_weight=norm) if normed else {}
        s = lora_rows_shrink(x, a, slots, pdl=pdl, **nkw)  # the small-batch forward's shrink
        mine = slots >= 0
        want_s = lora_shrink_ref(x.float(), a.float(), slots, **nkw)
        torch.testing.assert_close(s.sum(0)[mine], want_s[mine], atol=5e-2, rtol=2e-2)
        lora = LoraEpilogue(s, b, scale, slots, widths, rms=normed)
        if normed:
            kw.update(norm_weight=norm, eps=1e-5)
        got = fused_gemv(x, w, lora=lora, pdl=pdl, **kw)
        base = fused_gemv(x, w, pdl=pdl, **kw)
        want = fused_gemv_ref(x, w, lora=lora, **kw)
        torch.cuda.synchronize()
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=tol[0], rtol=tol[1])
        none = slots < 0
        assert torch.equal(got[none], base[none])
        assert not torch.equal(got[~none], base[~none])
        return got

    check(h, weight(sum(qkv), hidden), qkv, True)
    attn = torch.randn(rows, hidden, generator=g, device="cuda").bfloat16()
    check(attn, weight(hidden, hidden), (hidden,), False, residual=h)
    gate_up = weight(2 * inter, hidden)
    # act(gate) * up: a bf16 ulp of either, rounded differently, carried through the product
    act = check(h, gate_up[:inter], (inter, inter), True, (0.25, 0.05), up_weight=gate_up[inter:])
    check(act, weight(hidden, inter), (hidden,), False, residual=h)


@pytest.mark.gpu
@needs_gpu
def test_gpu_small_batch_lora_chain_replays_in_a_graph():
    """rows shrink -> GEMV (epilogue) -> rows shrink -> GEMV with PDL, captured and replayed:
    the same bits as the eager run, and a new slot assignment between replays is honoured."""
    from hf_paged.kernels.fused_gemv import pdl_available

    pdl = pdl_available(torch.device("cuda"))
    hidden, qkv, inter = SHAPES["1.1b"]
    g = torch.Generator(device="cuda").manual_seed(9)
    a1, b1, sc1 = _cuda_group(hidden, (hidden,), g)
    a2, b2, sc2 = _cuda_group(hidden, (inter, inter), g)
    w1 = (torch.randn(hidden, hidden, generator=g, device="cuda") / 45).bfloat16()
    w2 = (torch.randn(2 * inter, hidden, generator=g, device="cuda") / 45).bfloat16()
    norm = torch.ones(hidden, device="cuda").bfloat16()
    x = torch.randn(4, hidden, generator=g, device="cuda").bfloat16()
    slots = torch.tensor([0, -1, 5, 2], dtype=torch.int32, device="cuda")

    def step():
        s1 = lora_rows_shrink(x, a1, slots, pdl=pdl)
        h = fused_gemv(x, w1, residual=x, pdl=pdl, lora=LoraEpilogue(s1, b1, sc1, slots, (hidden,)))
        s2 = lora_rows_shrink(h, a2, slots, norm_weight=norm, pdl=pdl)
        lora = LoraEpilogue(s2, b2, sc2, slots, (inter, inter), rms=True)
        return fused_gemv(
            h, w2[:inter], up_weight=w2[inter:], norm_weight=norm, eps=1e-5, pdl=pdl, lora=lora
        )

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for assignment in ([0, -1, 5, 2], [7, 7, -1, 3]):
        slots.copy_(torch.tensor(assignment, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
    slots.copy_(torch.tensor([0, -1, 5, 2], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", ["1.1b", "8b"])
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_norm_qkv_rope_lora_real_shapes(shape, rows, pdl):
    from hf_paged.kernels import norm_qkv_rope, norm_qkv_rope_ref
    from hf_paged.kernels.fused_gemv import pdl_available

    if pdl and not pdl_available(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90")
    hidden, widths, _ = SHAPES[shape]
    d = 64 if shape == "1.1b" else 128
    hq, hkv = widths[0] // d, widths[1] // d
    g = torch.Generator(device="cuda").manual_seed(rows)
    a, b, scale = _cuda_group(hidden, widths, g)
    slots = torch.tensor([0, -1, 3, 7, 2, 5, -1, 1][:rows], dtype=torch.int32, device="cuda")
    x = torch.randn(rows, hidden, generator=g, device="cuda").bfloat16()
    w = (torch.randn(sum(widths), hidden, generator=g, device="cuda") / hidden**0.5).bfloat16()
    nw = (torch.rand(hidden, generator=g, device="cuda") + 0.5).bfloat16()
    angles = torch.randn(4096, d // 2, generator=g, device="cuda")
    pos = torch.randint(0, 4096, (rows,), generator=g, device="cuda")
    args = (pos, angles.cos().bfloat16(), angles.sin().bfloat16())
    cache_slots = torch.arange(rows, device="cuda") * 3
    caches = [torch.zeros(8, 16, hkv, d, device="cuda").bfloat16() for _ in range(6)]
    s = lora_rows_shrink(x, a, slots, norm_weight=nw, pdl=pdl)
    lora = LoraEpilogue(s, b, scale, slots, widths, rms=True)
    q = norm_qkv_rope(x, w, None, nw, 1e-5, *args, *caches[:2], cache_slots, hq, pdl=pdl, lora=lora)
    q_ref = norm_qkv_rope_ref(x, w, None, nw, 1e-5, *args, *caches[2:4], cache_slots, hq, lora=lora)
    q_base = norm_qkv_rope(x, w, None, nw, 1e-5, *args, *caches[4:], cache_slots, hq, pdl=pdl)
    torch.cuda.synchronize()
    tol = dict(atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(q.float(), q_ref.float(), **tol)
    torch.testing.assert_close(caches[0].float(), caches[2].float(), **tol)
    torch.testing.assert_close(caches[1].float(), caches[3].float(), **tol)
    none = slots < 0
    assert torch.equal(q[none], q_base[none])  # no adapter: the base kernel's bits
    assert not torch.equal(q[~none], q_base[~none])
