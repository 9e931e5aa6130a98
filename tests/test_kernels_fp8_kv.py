"""FP8 KV caches in the kernels: write_kv quantises (x / scale, saturated), paged_attention and
decode_attention dequantise (scale * stored) inside the kernel, all against the torch
references. CPU: Triton's interpreter at tiny shapes; `pytest -m gpu` adds Llama-3-8B heads.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from hf_paged.worker.forward_context import AttentionMetadata

kv_write_mod = importlib.import_module("hf_paged.kernels.kv_write")
pa_mod = importlib.import_module("hf_paged.kernels.paged_attention")
decode_attention = importlib.import_module("hf_paged.kernels.decode_attention").decode_attention
paged_attention, paged_attention_ref = pa_mod.paged_attention, pa_mod.paged_attention_ref
write_kv, write_kv_ref = kv_write_mod.write_kv, kv_write_mod.write_kv_ref

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# The kernels and the reference read the same stored FP8 values and the same scales, so they
# differ only as the float kernels do (tests/test_kernels_paged_attention.py's table): the
# dequantised rows are exact in the query's dtype (FP8 fits in bf16/fp16/fp32).
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (1.6e-2, 2e-2)}
if ON_GPU:
    TOL[torch.float32] = (1e-4, 1e-4)


def fp8_batch(q_lens, seq_lens, hq, hkv, d, cache_dtype, k_scale, v_scale, dtype, bs=16):
    """Queries, FP8 caches written through write_kv_ref at random blocks (NaN elsewhere), and
    the metadata; unused block-table entries point far out of range."""
    gen = torch.Generator().manual_seed(0)
    per_seq = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = sum(per_seq) + 3
    query = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    shape = (num_blocks, bs, hkv, d)
    key_cache = torch.full(shape, float("nan")).to(cache_dtype)
    value_cache = torch.full(shape, float("nan")).to(cache_dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(per_seq) + 1), 2**30, dtype=torch.int32)
    used = 0
    for i, (n, seq_len) in enumerate(zip(per_seq, seq_lens)):
        table[i, :n] = ids[used : used + n].int()
        used += n
        pos = torch.arange(seq_len)
        slots = table[i, pos // bs].long() * bs + pos % bs
        k = torch.randn(seq_len, hkv, d, generator=gen) * 3
        v = torch.randn(seq_len, hkv, d, generator=gen)
        write_kv_ref(k, v, key_cache, value_cache, slots, k_scale, v_scale)
    meta = AttentionMetadata.from_lengths(q_lens, seq_lens, table.to(DEVICE), host_lists=False)
    return query.to(DEVICE), key_cache.to(DEVICE), value_cache.to(DEVICE), meta


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_write_kv_fp8_matches_reference(cache_dtype, src):
    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(6, 3, 32, generator=gen) * 4).to(src)
    value = torch.randn(6, 3, 32, generator=gen).to(src)
    key[0, 0, 0] = 1e6  # saturates to the format's largest finite value, not inf/NaN
    slots = torch.tensor([7, -1, 0, 12, 3, 15])
    caches = [
        tuple(torch.zeros(4, 4, 3, 32, dtype=cache_dtype, device=DEVICE) for _ in range(2))
        for _ in range(2)
    ]
    args = (key.to(DEVICE), value.to(DEVICE))
    write_kv(*args, *caches[0], slots.to(DEVICE), k_scale=0.5, v_scale=0.03)
    write_kv_ref(*args, *caches[1], slots.to(DEVICE), k_scale=0.5, v_scale=0.03)
    for got, ref in zip(caches[0], caches[1]):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    fmax = kv_write_mod.FP8_MAX[cache_dtype]
    k_flat = caches[0][0].flatten(0, 1).float().cpu()
    assert k_flat[7, 0, 0] == fmax
    expected = (key[0].float() * 2.0).clamp(-fmax, fmax).to(cache_dtype).float()
    assert torch.equal(k_flat[7], expected)
    v_back = caches[0][1].flatten(0, 1)[12].float().cpu() * 0.03
    rel = 2.0**-3 if cache_dtype == torch.float8_e4m3fn else 2.0**-2  # half an ulp, relative
    assert torch.all((v_back - value[3].float()).abs() <= rel * value[3].float().abs() + 1e-6)
    assert torch.all(caches[0][0].flatten(0, 1)[1].float() == 0)  # slot -1 wrote nothing


def test_reference_dequantises_with_the_scales():
    # paged_attention_ref on an FP8 cache == the float reference on scale * stored values
    query, kc, vc, meta = fp8_batch(
        [3, 1], [20, 9], 4, 2, 16, torch.float8_e4m3fn, 0.25, 0.02, torch.float32
    )
    got = paged_attention_ref(query, kc, vc, meta, 0.25, k_scale=0.25, v_scale=0.02)
    ref = paged_attention_ref(query, kc.float() * 0.25, vc.float() * 0.02, meta, 0.25)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_fp8_mixed_batch(cache_dtype, dtype):
    args = ([5, 1, 17], [21, 33, 17], 4, 2, 16, cache_dtype, 0.4, 0.05, dtype)
    query, kc, vc, meta = fp8_batch(*args)
    got = paged_attention(query, kc, vc, meta, 0.25, softcap=30.0, k_scale=0.4, v_scale=0.05)
    ref = paged_attention_ref(query, kc, vc, meta, 0.25, softcap=30.0, k_scale=0.4, v_scale=0.05)
    assert not got.isnan().any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


def test_paged_attention_fp8_bf16_query_beyond_fp16_saturates():
    # bf16 queries over an FP8 cache are multiplied in fp16 (kernels/attention_common.py
    # fp16_query): an element past fp16's 65504 saturates there instead of becoming inf (and the
    # row NaN); here it dominates its row's scores either way, so the output stays the
    # reference's
    query, kc, vc, meta = fp8_batch([3, 1], [9, 20], 4, 2, 16, FP8[0], 0.4, 0.05, torch.bfloat16)
    query[0, 0, 0] = 3e5
    got = paged_attention(query, kc, vc, meta, 0.25, k_scale=0.4, v_scale=0.05)
    ref = paged_attention_ref(query, kc, vc, meta, 0.25, k_scale=0.4, v_scale=0.05)
    assert got.isfinite().all()
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_fp8_split_decode_and_window(splits):
    query, kc, vc, meta = fp8_batch(
        [1, 1], [70, 9], 4, 1, 32, torch.float8_e4m3fn, 0.3, 0.1, torch.float32
    )
    kw = dict(sliding_window=40, num_kv_splits=splits, k_scale=0.3, v_scale=0.1)
    got = paged_attention(query, kc, vc, meta, 0.2, **kw)
    ref = paged_attention_ref(query, kc, vc, meta, 0.2, 40, k_scale=0.3, v_scale=0.1)
    torch.testing.assert_close(got, ref, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_attention_fp8(splits):
    query, kc, vc, meta = fp8_batch(
        [1, 1, 1], [1, 40, 70], 4, 2, 16, torch.float8_e5m2, 0.7, 0.2, torch.float32
    )
    got = decode_attention(
        query, kc, vc, meta, 0.25, num_kv_splits=splits, k_scale=0.7, v_scale=0.2
    )
    ref = paged_attention_ref(query, kc, vc, meta, 0.25, k_scale=0.7, v_scale=0.2)
    torch.testing.assert_close(got, ref, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scales_raise_value_error(bad):
    query, kc, vc, meta = fp8_batch(
        [1], [5], 2, 1, 16, torch.float8_e4m3fn, 1.0, 1.0, torch.float32
    )
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(query, kc, vc, meta, 0.25, k_scale=bad)
    with pytest.raises(ValueError, match="v_scale"):
        write_kv(query[:, :1], query[:, :1], kc, vc, torch.zeros(1, dtype=torch.long), v_scale=bad)


def test_mixed_fp8_formats_refused():
    query, kc, vc, meta = fp8_batch(
        [1], [5], 2, 1, 16, torch.float8_e4m3fn, 1.0, 1.0, torch.float32
    )
    with pytest.raises(ValueError, match="value_cache dtype"):
        paged_attention(query, kc, vc.to(torch.float8_e5m2), meta, 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize(
    "q_lens,seq_lens", [([1] * 8, [8200] * 4 + [33] * 4), ([512, 1, 1], [4096, 9000, 17])]
)
def test_fp8_kv_real_shapes_gpu(cache_dtype, q_lens, seq_lens):
    # Llama-3-8B heads (32 q, 8 kv, 128), bf16 queries, contexts past 8k, a mixed batch
    query, kc, vc, meta = fp8_batch(
        q_lens, seq_lens, 32, 8, 128, cache_dtype, 0.05, 0.01, torch.bfloat16
    )
    got = paged_attention(query, kc, vc, meta, 128**-0.5, k_scale=0.05, v_scale=0.01)
    ref = paged_attention_ref(query, kc, vc, meta, 128**-0.5, k_scale=0.05, v_scale=0.01)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    if max(q_lens) == 1:
        dec = decode_attention(query, kc, vc, meta, 128**-0.5, k_scale=0.05, v_scale=0.01)
        torch.testing.assert_close(dec.float(), ref.float(), atol=2e-2, rtol=2e-2)
