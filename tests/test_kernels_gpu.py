"""Kernel checks at real shapes on a CUDA GPU (`pytest -m gpu tests/test_kernels_gpu.py`).

Not run in CI (no GPU there). Llama-3-8B attention heads (32 q, 8 kv, head_dim 128) in bf16 and
fp16, contexts to 8k+ and 32k, mixed batches, and a cache large enough that block_id * block
stride passes 2^31 elements (int64 addressing). Every output is NaN-poisoned before the call and
the cache is NaN outside the written context.
"""

from __future__ import annotations

import math

import pytest
import torch
from hf_paged.kernels import paged_attention, paged_attention_ref, write_kv, write_kv_ref
from hf_paged.kernels.kv_write import interpreting

from hf_paged.worker.forward_context import AttentionMetadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HQ, HKV, D = 32, 8, 128
# (atol, rtol, relative-norm bound) against the float32 reference on the same rounded inputs,
# at real shapes (up to 32k keys: longer sums than the CPU tests allow):
# | dtype    | ulp at 1 | atol | rtol | norm | why                                          |
# | float16  | 9.8e-4   | 3e-3 | 5e-3 | 2e-3 | P and the output rounded to fp16: <= 3 ulp,  |
# |          |          |      |      |      | 2 ulp of the output's norm                   |
# | bfloat16 | 7.8e-3   | 2e-2 | 2e-2 | 1e-2 | the same roundings at bf16's 8-bit mantissa  |
TOL = {torch.bfloat16: (2e-2, 2e-2, 1e-2), torch.float16: (3e-3, 5e-3, 2e-3)}


def build(
    q_lens,
    seq_lens,
    dtype,
    num_q_heads=HQ,
    num_kv_heads=HKV,
    head_dim=D,
    block_size=16,
    num_blocks=None,
    high_block_ids=False,
    seed=0,
):
    """Paged batch on the GPU; the context is written with write_kv (so write_kv is exercised at
    real sizes too), the rest of the cache is NaN."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    needed = sum(blocks_per_seq)
    num_blocks = num_blocks or needed + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.empty(shape, device="cuda", dtype=dtype)
    value_cache = torch.empty(shape, device="cuda", dtype=dtype)
    if high_block_ids:
        ids = num_blocks - needed + torch.randperm(needed, device="cuda", generator=g)
        # poison only the touched region: filling a multi-GB cache would cost seconds
        key_cache[num_blocks - needed - 1 :].fill_(float("nan"))
        value_cache[num_blocks - needed - 1 :].fill_(float("nan"))
    else:
        ids = torch.randperm(num_blocks, device="cuda", generator=g)[:needed]
        key_cache.fill_(float("nan"))
        value_cache.fill_(float("nan"))
    max_blocks = max(blocks_per_seq) + 1
    block_table = torch.full((len(seq_lens), max_blocks), 2**30, dtype=torch.int32, device="cuda")
    slots = []
    pos = 0
    for i, (n, s) in enumerate(zip(blocks_per_seq, seq_lens)):
        block_table[i, :n] = ids[pos : pos + n].int()
        pos += n
        tok = torch.arange(s, device="cuda")
        slots.append(block_table[i, tok // block_size].long() * block_size + tok % block_size)
    slots = torch.cat(slots)
    k = torch.randn(len(slots), num_kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(len(slots), num_kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    write_kv(k, v, key_cache, value_cache, slots)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_q_heads, head_dim, device="cuda", generator=g).to(dtype)
    meta = AttentionMetadata.from_lengths(q_lens, seq_lens, block_table)
    return query, key_cache, value_cache, meta


def check(
    query,
    key_cache,
    value_cache,
    meta,
    dtype,
    sliding_window=None,
    softcap=None,
    num_kv_splits=None,
):
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, float("nan"))
    paged_attention(
        query,
        key_cache,
        value_cache,
        meta,
        scale,
        sliding_window,
        softcap,
        out=out,
        num_kv_splits=num_kv_splits,
    )
    ref = paged_attention_ref(query, key_cache, value_cache, meta, scale, sliding_window, softcap)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element or NaN leak)"
    atol, rtol, rel = TOL[dtype]
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < rel, f"relative error {err:.2e}"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


DTYPES = [torch.bfloat16, torch.float16]


def test_compiled_not_interpreted():
    assert not interpreting()


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_batch_64_to_8k(dtype):
    g = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(1, 8300, (64,), generator=g).tolist()
    check(*build([1] * 64, seq_lens, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_chunks_and_decodes(dtype):
    q_lens = [2048, 1000, 512, 3] + [1] * 32
    seq_lens = [5120, 1000, 8192, 700] + [257 * i + 1 for i in range(32)]
    check(*build(q_lens, seq_lens, dtype), dtype)


def test_prefill_8k_single_sequence():
    check(*build([8192], [8192], torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("num_kv_splits", [None, 16])
def test_long_context_split_kv(num_kv_splits):
    check(
        *build([1, 1], [32768, 20000], torch.bfloat16), torch.bfloat16, num_kv_splits=num_kv_splits
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_and_softcap(dtype):
    q_lens = [1024, 1, 1, 7]
    seq_lens = [6000, 9000, 100, 4100]
    batch = build(q_lens, seq_lens, dtype)
    check(*batch, dtype, sliding_window=4096)
    check(*batch, dtype, softcap=30.0)
    check(*batch, dtype, sliding_window=1000, softcap=50.0, num_kv_splits=8)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size",
    [
        (8, 8, 64, 16),
        (28, 4, 128, 32),
        (14, 2, 64, 64),
        (32, 4, 80, 16),
        (12, 12, 96, 32),
        (16, 8, 256, 16),
        (32, 32, 128, 16),
    ],
)
def test_head_configs(num_q_heads, num_kv_heads, head_dim, block_size):
    q_lens = [700, 1, 1, 64]
    seq_lens = [900, 3000, 17, 64]
    kw = {
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
    }
    check(*build(q_lens, seq_lens, torch.bfloat16, **kw), torch.bfloat16)
    decode = build([1] * 8, [5000] * 8, torch.float16, **kw)
    check(*decode, torch.float16)


def test_large_cache_int64_addressing():
    # block stride 16 * 8 * 128 = 16384 elements: ids >= 131072 put block_id * stride past 2^31.
    num_blocks = 140_000  # 2 x 4.6 GB in bf16
    if torch.cuda.mem_get_info()[0] < 12e9:
        pytest.skip("needs ~10 GB free")
    q_lens = [300, 1, 1]
    seq_lens = [4000, 8000, 33]
    batch = build(q_lens, seq_lens, torch.bfloat16, num_blocks=num_blocks, high_block_ids=True)
    assert int(batch[3].block_table[:, 0].min()) * 16 * HKV * D > 2**31
    check(*batch, torch.bfloat16)
    check(*batch, torch.bfloat16, num_kv_splits=4)
    del batch
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_kv_real_shapes(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    num_blocks, num_tokens = 4096, 8192
    kc = torch.randn(num_blocks, 16, HKV, D, device="cuda", generator=g).to(dtype)
    vc = torch.randn_like(kc)
    key = torch.randn(num_tokens, HKV, D, device="cuda", generator=g)  # float32 -> cast
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * 16, device="cuda", generator=g)[:num_tokens]
    slots[::5] = -1
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv(key, value, kc, vc, slots)
    write_kv_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_write_kv_large_cache_high_slots():
    num_blocks = 140_000
    if torch.cuda.mem_get_info()[0] < 12e9:
        pytest.skip("needs ~10 GB free")
    kc = torch.zeros(num_blocks, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    key = torch.randn(64, HKV, D, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.arange(num_blocks * 16 - 64, num_blocks * 16, device="cuda")
    write_kv(key, value, kc, vc, slots)
    assert torch.equal(kc[-4:].reshape(64, HKV, D), key)
    assert torch.equal(vc[-4:].reshape(64, HKV, D), value)
    assert int(torch.count_nonzero(kc[:-4])) == 0


# 1.1B and 8B projection shapes (K, N) at batch 1-8, with programmatic dependent launch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_fused_gemv_real_shapes(dtype, rows):
    from hf_paged.kernels import fused_gemv, fused_gemv_ref

    g = torch.Generator(device="cuda").manual_seed(rows)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    for k, n in ((2048, 2560), (2048, 5632), (5632, 2048), (4096, 6144), (2048, 32000)):

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

        x, w, w2 = rnd(rows + 3, k), rnd(n, k, scale=0.02), rnd(n, k, scale=0.02)
        nw, res = rnd(k).abs() + 0.5, rnd(rows, n)
        picked = torch.randperm(rows + 3, device="cuda", generator=g)[:rows]
        for kw in (
            dict(norm_weight=nw, eps=1e-5),
            dict(norm_weight=nw, eps=1e-6, up_weight=w2),
            dict(residual=res),
            dict(norm_weight=nw, eps=1e-5, rows=picked),
        ):
            xx = x if "rows" in kw else x[:rows]
            want = fused_gemv_ref(xx, w, **kw).float()
            for pdl in (False, True):
                got = fused_gemv(xx, w, pdl=pdl, **kw).float()
                torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=str((k, n, kw)))


def test_rope_write_kv_real_shapes():
    from hf_paged.kernels import rope_write_kv, rope_write_kv_ref

    for dtype, hq, hkv, d in ((torch.bfloat16, 32, 4, 64), (torch.float32, 32, 8, 128)):
        t = 7
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda").to(dtype)
        cos, sin = torch.randn(t, d, device="cuda").to(dtype), torch.randn(t, d, device="cuda")
        sin = sin.to(dtype)
        caches = [torch.zeros(64, 16, hkv, d, device="cuda", dtype=dtype) for _ in range(4)]
        slots = torch.tensor([5, -1, 900, 17, 1000, 3, 44], device="cuda")
        for pdl in (False, True):
            for c in caches:
                c.zero_()
            q = rope_write_kv(qkv, cos, sin, caches[0], caches[1], slots, hq, pdl=pdl)
            q_ref = rope_write_kv_ref(qkv, cos, sin, caches[2], caches[3], slots, hq)
            # each op rounds as torch rounds, but Triton contracts x * cos + y * sin into an FMA
            # (float32: last-bit differences), and bf16 conversions may differ in the last bit
            if dtype == torch.float32:
                tol = dict(atol=1e-6, rtol=1e-5)
            else:
                tol = dict(atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(q, q_ref, **tol)
            torch.testing.assert_close(caches[0], caches[2], **tol)
            assert torch.equal(caches[1], caches[3])  # values are copied, not computed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_qkv_rope_real_shapes(dtype):
    from hf_paged.kernels import norm_qkv_rope, norm_qkv_rope_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    for k, hq, hkv, d, rows in ((2048, 32, 4, 64, 1), (4096, 32, 8, 128, 2), (3584, 28, 4, 128, 5)):
        n = (hq + 2 * hkv) * d

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

        x, w, b, nw = rnd(rows, k), rnd(n, k, scale=0.02), rnd(n), rnd(k).abs() + 0.5
        angles = torch.rand(4096, d // 2, device="cuda", generator=g) * 100
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        positions = torch.randint(0, 4096, (rows,), device="cuda", generator=g)
        slots = torch.randperm(64 * 16, device="cuda", generator=g)[:rows]
        slots[0] = -1 if rows > 1 else slots[0]
        for pdl in (False, True):
            caches = [torch.zeros(64, 16, hkv, d, device="cuda", dtype=dtype) for _ in range(4)]
            args = (positions, cos, sin)
            q = norm_qkv_rope(x, w, b, nw, 1e-5, *args, caches[0], caches[1], slots, hq, pdl=pdl)
            q_ref = norm_qkv_rope_ref(x, w, b, nw, 1e-5, *args, caches[2], caches[3], slots, hq)
            tol = 2e-4 if dtype == torch.float32 else 5e-2
            for a, want in ((q, q_ref), (caches[0], caches[2]), (caches[1], caches[3])):
                torch.testing.assert_close(a.float(), want.float(), atol=tol, rtol=tol)


def test_paged_attention_pdl_launch_changes_nothing():
    # decode batches of 1-8 with and without the flash-decoding split: PDL on == PDL off
    from hf_paged.kernels import paged_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    for batch, ctx_len, splits in ((1, 300, 4), (2, 2000, 8), (8, 64, 1)):
        q = torch.randn(batch, 32, 64, device="cuda", generator=g).to(torch.bfloat16)
        kc = torch.randn(256, 16, 4, 64, device="cuda", generator=g).to(torch.bfloat16)
        vc = torch.randn(256, 16, 4, 64, device="cuda", generator=g).to(torch.bfloat16)
        width = -(-ctx_len // 16)
        table = torch.randint(0, 256, (batch, width), device="cuda", generator=g).int()
        meta = AttentionMetadata.from_lengths([1] * batch, [ctx_len] * batch, table)
        want = paged_attention(q, kc, vc, meta, 0.125, num_kv_splits=splits)
        got = paged_attention(q, kc, vc, meta, 0.125, num_kv_splits=splits, pdl=True)
        assert torch.equal(got, want)


@pytest.mark.parametrize("pdl", [False, True])
def test_decode_attention_after_the_kernel_that_writes_the_new_token(pdl):
    # norm_qkv_rope writes this step's K/V row; decode_attention reads every older key before
    # its PDL wait and the new row after it. Chained 20 times with fresh rows, at the 1.1B, 8B
    # and Qwen2.5-7B head shapes, against the reference read after a sync, and against the
    # general kernel.
    from hf_paged.kernels import decode_attention, norm_qkv_rope

    g = torch.Generator(device="cuda").manual_seed(0)
    for k, hq, hkv, d, ctx, batch, splits in (
        (2048, 32, 4, 64, 256, 1, 4),
        (2048, 32, 4, 64, 1000, 2, 4),
        (4096, 32, 8, 128, 129, 1, None),
        (2048, 32, 4, 64, 1500, 1, None),  # the default: one 128-key tile a split, 11 splits
        (3584, 28, 4, 128, 3000, 8, 16),
    ):
        bf = torch.bfloat16
        n = (hq + 2 * hkv) * d
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(bf)
        nw = torch.rand(k, device="cuda", generator=g).to(bf) + 0.5
        angles = torch.rand(8192, d // 2, device="cuda", generator=g) * 100
        cos, sin = angles.cos().to(bf), angles.sin().to(bf)
        width = -(-(ctx + 20) // 16)
        blocks = batch * width
        kc = torch.randn(blocks, 16, hkv, d, device="cuda", generator=g).to(bf)
        vc = torch.randn(blocks, 16, hkv, d, device="cuda", generator=g).to(bf)
        table = torch.randperm(blocks, device="cuda", generator=g).int().view(batch, width)
        for step in range(20):
            seq_len = ctx + step
            meta = AttentionMetadata.from_lengths([1] * batch, [seq_len] * batch, table)
            pos = torch.full((batch,), seq_len - 1, device="cuda", dtype=torch.int64)
            slots = table[:, (seq_len - 1) // 16].long() * 16 + (seq_len - 1) % 16
            x = torch.randn(batch, k, device="cuda", generator=g).to(bf)
            q = norm_qkv_rope(x, w, None, nw, 1e-5, pos, cos, sin, kc, vc, slots, hq, pdl=pdl)
            got = decode_attention(q, kc, vc, meta, d**-0.5, num_kv_splits=splits, pdl=pdl)
            torch.cuda.synchronize()
            ref = paged_attention_ref(q, kc, vc, meta, d**-0.5)
            torch.testing.assert_close(got.float(), ref.float(), atol=1.6e-2, rtol=2e-2)
            general = paged_attention(q, kc, vc, meta, d**-0.5, num_kv_splits=splits)
            torch.testing.assert_close(got.float(), general.float(), atol=4e-3, rtol=5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [32000, 128256, 151936])
def test_argmax_rows_real_shapes(dtype, vocab):
    from hf_paged.kernels import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(vocab)
    x = torch.randn(7, vocab, device="cuda", generator=g).to(dtype)
    x[1, [5, vocab - 1]] = 100.0  # a tie across chunks: the first
    x[2] = float("-inf")
    x[3, vocab // 2] = float("nan")
    x[4, 40000 % vocab] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[::2]), x[::2].argmax(dim=-1))  # rows at a stride


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [32000, 49152, 128256])
def test_argmax_rows_allowed_real_shapes(dtype, vocab):
    """The grammar-masked argmax against xgrammar's own CUDA mask then torch.argmax: 256 rows,
    some masked, some not, one with no token allowed."""
    xgr = pytest.importorskip("xgrammar")
    from hf_paged.kernels import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(vocab)
    rows, width = 256, (vocab + 31) // 32
    x = torch.randn(rows, vocab, device="cuda", generator=g).to(dtype)
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, width), device="cuda", generator=g)
    bits = bits.to(torch.int32)
    bits[::7] &= 0x01010101  # sparse rows: a few tokens allowed
    bits[5] = 0  # nothing allowed: 0, as argmax of a row of -inf
    sel = [i for i in range(rows) if i % 3]
    on = torch.zeros(rows, dtype=torch.int32, device="cuda")
    on[sel] = 1
    for indices, flags in ((None, None), (sel, on)):
        ref = x.float().clone()
        xgr.apply_token_bitmask_inplace(ref, bits, vocab_size=vocab, indices=indices)
        got = argmax_rows(x, allowed=(bits, flags))
        assert torch.equal(got, ref.argmax(dim=-1))


@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_embed_tokens_real_shapes(hidden):
    from hf_paged.kernels import embed_tokens, embed_tokens_ref

    w = torch.randn(32000, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([0, 31999, 17, 17, 4096], device="cuda")
    pending = torch.tensor([False, True, False, True, False], device="cuda")
    rows = torch.tensor([0, 3, 1, 0, 2], device="cuda")
    last = torch.tensor([11, 12, 13, 31000], device="cuda")
    for pdl in (False, True):
        got = embed_tokens(w, ids, pending, rows, last, pdl=pdl)
        assert torch.equal(got, embed_tokens_ref(w, ids, pending, rows, last))
        assert torch.equal(embed_tokens(w, ids, pdl=pdl), w[ids])
