"""The attention kernels' optional features at real shapes on a CUDA GPU
(`pytest -m gpu tests/test_kernels_gpu_features.py`); not run in CI. Attention sinks at gpt-oss's
heads (64 q, 8 kv, head_dim 64, 128-token windows on alternate layers); keys and values of
different head sizes at DeepSeek-V3's (keys 192, values 128; 16 of its 128 MHA heads) and
MiMo-V2's (64 q, 8 kv heads). Against the float32 reference on the same rounded inputs; every
output is NaN-poisoned before the call and the cache is NaN outside the written context."""

from __future__ import annotations

import math

import pytest
import torch
from hf_paged.kernels import (
    decode_attention,
    paged_attention,
    paged_attention_ref,
    write_kv,
    write_kv_ref,
)

from hf_paged.worker.forward_context import AttentionMetadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (atol, rtol, relative-norm bound) as tests/test_kernels_gpu.py sets them, and why
TOL = {torch.bfloat16: (2e-2, 2e-2, 1e-2), torch.float16: (3e-3, 5e-3, 2e-3)}
DTYPES = [torch.bfloat16, torch.float16]
GPT_OSS = dict(hq=64, hkv=8, d=64)


def build(q_lens, seq_lens, dtype, hq, hkv, d, dv=None, block_size=16, seed=0):
    dv = d if dv is None else dv
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    key_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), device="cuda")
    value_cache = torch.full((num_blocks, block_size, hkv, dv), float("nan"), device="cuda")
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    ids = torch.randperm(num_blocks, device="cuda", generator=g)
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), 2**30, dtype=torch.int32)
    table = table.cuda()
    used = 0
    for i, (n, s) in enumerate(zip(blocks_per_seq, seq_lens)):
        table[i, :n] = ids[used : used + n].int()
        used += n
        pos = torch.arange(s, device="cuda")
        blocks, offs = table[i, pos // block_size].long(), pos % block_size
        key_cache[blocks, offs] = torch.randn(s, hkv, d, device="cuda", generator=g).to(dtype)
        value_cache[blocks, offs] = torch.randn(s, hkv, dv, device="cuda", generator=g).to(dtype)
    query = torch.randn(sum(q_lens), hq, d, device="cuda", generator=g).to(dtype)
    return query, key_cache, value_cache, AttentionMetadata.from_lengths(q_lens, seq_lens, table)


def close(out, ref, dtype):
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element or NaN leak)"
    atol, rtol, rel = TOL[dtype]
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < rel, f"relative error {err:.2e}"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def sinks(hq):
    g = torch.Generator(device="cuda").manual_seed(3)
    return torch.randn(hq, device="cuda", generator=g) * 2.0 + 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 128])
def test_sinks_mixed_batch(dtype, window):
    q_lens = [2048, 700, 3] + [1] * 32
    seq_lens = [4096, 700, 900] + [257 * i + 1 for i in range(32)]
    q, kc, vc, meta = build(q_lens, seq_lens, dtype, **GPT_OSS)
    s = sinks(GPT_OSS["hq"])
    scale = 64**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, meta, scale, window, None, out=out, sinks=s)
    close(out, paged_attention_ref(q, kc, vc, meta, scale, window, None, s), dtype)


@pytest.mark.parametrize("num_kv_splits", [None, 16])
def test_sinks_long_decode_split_kv(num_kv_splits):
    q, kc, vc, meta = build([1, 1, 1], [32768, 20000, 5], torch.bfloat16, **GPT_OSS)
    s = sinks(GPT_OSS["hq"])
    out = paged_attention(q, kc, vc, meta, 0.125, sinks=s, num_kv_splits=num_kv_splits)
    close(out, paged_attention_ref(q, kc, vc, meta, 0.125, sinks=s), torch.bfloat16)


@pytest.mark.parametrize("splits", [None, 1, 8])
def test_decode_attention_sinks(splits):
    q, kc, vc, meta = build([1] * 4, [6000, 128, 129, 3], torch.bfloat16, **GPT_OSS)
    s = sinks(GPT_OSS["hq"])
    out = decode_attention(q, kc, vc, meta, 0.125, 128, None, sinks=s, num_kv_splits=splits)
    close(out, paged_attention_ref(q, kc, vc, meta, 0.125, 128, None, s), torch.bfloat16)


MLA = dict(hq=16, hkv=16, d=192, dv=128)  # DeepSeek-V3's head sizes, 16 of its heads
MIMO = dict(hq=64, hkv=8, d=192, dv=128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [MLA, MIMO], ids=["deepseek_v3", "mimo_v2"])
def test_kv_head_dims_mixed_batch(dtype, shape):
    q_lens = [2048, 700, 3] + [1] * 16
    seq_lens = [4096, 700, 900] + [513 * i + 1 for i in range(16)]
    q, kc, vc, meta = build(q_lens, seq_lens, dtype, **shape)
    scale = shape["d"] ** -0.5
    out = torch.full((q.shape[0], shape["hq"], shape["dv"]), float("nan"), device="cuda")
    out = out.to(dtype)
    paged_attention(q, kc, vc, meta, scale, out=out)
    close(out, paged_attention_ref(q, kc, vc, meta, scale), dtype)


@pytest.mark.parametrize("num_kv_splits", [None, 16])
def test_kv_head_dims_long_decode_split_kv_with_sinks(num_kv_splits):
    q, kc, vc, meta = build([1, 1, 1], [32768, 20000, 5], torch.bfloat16, **MIMO)
    s = sinks(MIMO["hq"])
    out = paged_attention(q, kc, vc, meta, 0.07, 128, None, sinks=s, num_kv_splits=num_kv_splits)
    close(out, paged_attention_ref(q, kc, vc, meta, 0.07, 128, None, s), torch.bfloat16)


@pytest.mark.parametrize("splits", [None, 8])
def test_decode_attention_kv_head_dims(splits):
    q, kc, vc, meta = build([1] * 4, [6000, 128, 129, 3], torch.bfloat16, **MLA)
    out = decode_attention(q, kc, vc, meta, 0.07, num_kv_splits=splits)
    close(out, paged_attention_ref(q, kc, vc, meta, 0.07), torch.bfloat16)


def test_write_kv_kv_head_dims():
    g = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(300, 16, 192, device="cuda", generator=g).to(torch.bfloat16)
    value = torch.randn(300, 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:300]
    slots[::7] = -1
    caches = [
        (
            torch.zeros(64, 16, 16, 192, device="cuda", dtype=torch.bfloat16),
            torch.zeros(64, 16, 16, 128, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(2)
    ]
    write_kv(key, value, *caches[0], slots)
    write_kv_ref(key, value, *caches[1], slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
