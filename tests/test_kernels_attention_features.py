"""The attention kernels' optional features against paged_attention_ref on small shapes:
attention sinks (gpt-oss's s_aux), and values whose heads are narrower or wider than the keys'
(MLA models unabsorbed), with write_kv. Interpreted on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU), compiled on a CUDA machine; real shapes are in
tests/test_kernels_gpu_features.py.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from hf_paged.worker.forward_context import AttentionMetadata

# import_module: the package re-exports functions named like their modules
pa_mod = importlib.import_module("hf_paged.kernels.paged_attention")
decode_attention = importlib.import_module("hf_paged.kernels.decode_attention").decode_attention
AttentionConfig = importlib.import_module("hf_paged.kernels.attention_config").AttentionConfig
paged_attention, paged_attention_ref = pa_mod.paged_attention, pa_mod.paged_attention_ref

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# (atol, rtol) as tests/test_kernels_paged_attention.py sets them, and why
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.6e-2, 2e-2)}
if ON_GPU:
    TOL[torch.float32] = (1e-4, 1e-4)


def make_batch(q_lens, seq_lens, hq, hkv, d, dtype=torch.float32, block_size=16, dv=None):
    """Random queries and a NaN-poisoned paged cache holding each sequence's context at random
    blocks (V rows dv wide, d by default); unused block-table entries point out of range."""
    dv = d if dv is None else dv
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    query = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    key_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    value_cache = torch.full((num_blocks, block_size, hkv, dv), float("nan"), dtype=dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), 2**30, dtype=torch.int32)
    used = 0
    for i, (n, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        block_table[i, :n] = ids[used : used + n].int()
        used += n
        pos = torch.arange(seq_len)
        blocks, offs = block_table[i, pos // block_size].long(), pos % block_size
        key_cache[blocks, offs] = torch.randn(seq_len, hkv, d, generator=gen).to(dtype)
        value_cache[blocks, offs] = torch.randn(seq_len, hkv, dv, generator=gen).to(dtype)
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, block_table.to(DEVICE), host_lists=False
    )
    return query.to(DEVICE), key_cache.to(DEVICE), value_cache.to(DEVICE), meta


def sinks_for(num_q_heads: int, seed: int = 1) -> torch.Tensor:
    # logits around the scores' own range (|q.k| * scale ~ 1), some far above: a sink that
    # dominates the denominator must shrink the output, not just rescale it
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(num_q_heads, generator=gen) * 2.0
    sinks[0] = 6.0
    return sinks.to(DEVICE)


def eager_sinks_attention(q, k, v, sinks, scale):
    """transformers' gpt_oss eager attention for one sequence, [T, H, D] in and out (MHA)."""
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale
    causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(k.shape[0] - q.shape[0])
    scores = scores.masked_fill(~causal, float("-inf"))
    sink = sinks.float().reshape(-1, 1, 1).expand(-1, q.shape[0], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("hts,shd->thd", probs, v.float())


def test_reference_sinks_match_transformers_eager_formula():
    q_lens, seq_lens = [5], [9]
    query, key_cache, value_cache, meta = make_batch(q_lens, seq_lens, 4, 4, 16)
    sinks = sinks_for(4)
    ref = paged_attention_ref(query, key_cache, value_cache, meta, 0.25, sinks=sinks)
    blocks = meta.block_table[0, :1].long()
    k = key_cache[blocks].reshape(-1, 4, 16)[:9]
    v = value_cache[blocks].reshape(-1, 4, 16)[:9]
    torch.testing.assert_close(ref, eager_sinks_attention(query, k, v, sinks, 0.25))
    # and the sink does something: without it the output differs
    plain = paged_attention_ref(query, key_cache, value_cache, meta, 0.25)
    assert (plain - ref).abs().max() > 1e-2


def check_sinks(q_lens, seq_lens, hq, hkv, d, dtype=torch.float32, **kw):
    query, key_cache, value_cache, meta = make_batch(q_lens, seq_lens, hq, hkv, d, dtype=dtype)
    sinks = sinks_for(hq)
    scale = d**-0.5
    window, softcap = kw.pop("sliding_window", None), kw.pop("softcap", None)
    out = torch.full_like(query, float("nan"))
    paged_attention(
        query, key_cache, value_cache, meta, scale, window, softcap, out=out, sinks=sinks, **kw
    )
    ref = paged_attention_ref(query, key_cache, value_cache, meta, scale, window, softcap, sinks)
    assert not torch.isnan(out).any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return query, key_cache, value_cache, meta, sinks


def test_sinks_mixed_prefill_and_decode():
    check_sinks([1, 20, 3, 1], [9, 20, 40, 70], 4, 2, 32)


@pytest.mark.parametrize("splits", [2, 5])
def test_sinks_split_kv_counted_once(splits):
    check_sinks([1, 1, 1], [3, 60, 150], 8, 2, 16, num_kv_splits=splits)


def test_sinks_with_window_softcap_bf16():
    check_sinks([1, 17], [50, 40], 4, 1, 16, torch.bfloat16, sliding_window=8, softcap=2.0)


def test_sinks_small_tiles_many_edges():
    cfg = AttentionConfig(16, 4, 16, num_warps=4, num_stages=1, one_tile_per_seq=False)
    check_sinks([7, 13], [30, 13], 8, 2, 16, config=cfg)


@pytest.mark.parametrize("splits", [None, 3])
def test_decode_attention_sinks(splits):
    seq_lens = [1, 40, 129]
    query, key_cache, value_cache, meta = make_batch([1] * 3, seq_lens, 6, 2, 16)
    sinks = sinks_for(6)
    got = decode_attention(
        query, key_cache, value_cache, meta, 0.25, 16, None, sinks=sinks, num_kv_splits=splits
    )
    ref = paged_attention_ref(query, key_cache, value_cache, meta, 0.25, 16, None, sinks)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


@pytest.mark.parametrize(
    "sinks, match",
    [
        (torch.zeros(3), r"sinks must be \[num_q_heads=4\]"),
        (torch.zeros(4, 1), r"sinks must be \[num_q_heads=4\]"),
        (torch.zeros(4, dtype=torch.int32), "sinks must be a float tensor"),
    ],
)
def test_bad_sinks_raise_value_error(sinks, match):
    query, key_cache, value_cache, meta = make_batch([1], [5], 4, 2, 16)
    with pytest.raises(ValueError, match=match):
        paged_attention(query, key_cache, value_cache, meta, 0.25, sinks=sinks.to(DEVICE))


# ---- values of another head size than keys (DeepSeek-V3: keys 192, values 128) --------------


def check_kv_dims(q_lens, seq_lens, hq, hkv, d, dv, dtype=torch.float32, **kw):
    query, key_cache, value_cache, meta = make_batch(q_lens, seq_lens, hq, hkv, d, dtype, dv=dv)
    window, softcap = kw.pop("sliding_window", None), kw.pop("softcap", None)
    sinks = kw.pop("sinks", None)
    out = torch.full((query.shape[0], hq, dv), float("nan"), dtype=dtype, device=DEVICE)
    paged_attention(
        query, key_cache, value_cache, meta, d**-0.5, window, softcap, out=out, sinks=sinks, **kw
    )
    ref = paged_attention_ref(query, key_cache, value_cache, meta, d**-0.5, window, softcap, sinks)
    assert ref.shape == (query.shape[0], hq, dv)
    assert not torch.isnan(out).any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return query, key_cache, value_cache, meta


@pytest.mark.parametrize("d, dv", [(24, 16), (16, 32), (48, 80)])
def test_kv_head_dims_mixed_batch(d, dv):
    # narrower and wider values; 24, 48 and 80 are padded to powers of two inside the kernels
    check_kv_dims([1, 20, 3, 1], [9, 20, 40, 70], 4, 2, d, dv)


@pytest.mark.parametrize("splits", [2, 5])
def test_kv_head_dims_split_kv(splits):
    check_kv_dims([1, 1, 1], [3, 60, 150], 4, 4, 24, 16, num_kv_splits=splits)


def test_kv_head_dims_window_softcap_sinks_bf16():
    check_kv_dims(
        [1, 17], [50, 40], 4, 1, 24, 16, torch.bfloat16, sliding_window=8, softcap=2.0,
        sinks=sinks_for(4),
    )  # fmt: skip


def test_kv_head_dims_unowned_tokens_zeroed():
    query, key_cache, value_cache, meta = make_batch([3, 1], [3, 9], 4, 2, 24, dv=16)
    padded = torch.cat([query, torch.randn(5, 4, 24, device=DEVICE)])
    out = paged_attention(padded, key_cache, value_cache, meta, 0.2)
    assert out.shape == (9, 4, 16)
    assert torch.equal(out[4:], torch.zeros(5, 4, 16, device=DEVICE))


@pytest.mark.parametrize("splits", [None, 3])
def test_decode_attention_kv_head_dims(splits):
    query, key_cache, value_cache, meta = make_batch([1] * 3, [1, 40, 129], 6, 2, 24, dv=16)
    got = decode_attention(query, key_cache, value_cache, meta, 0.2, num_kv_splits=splits)
    ref = paged_attention_ref(query, key_cache, value_cache, meta, 0.2)
    assert got.shape == (3, 6, 16)
    torch.testing.assert_close(got, ref, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


@pytest.mark.parametrize("dv", [16, 40])
def test_write_kv_value_head_dim(dv):
    from hf_paged.kernels import write_kv, write_kv_ref

    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(5, 3, 24, generator=gen), torch.randn(5, 3, dv, generator=gen)
    slots = torch.tensor([7, -1, 0, 12, 3])
    caches = [
        (torch.zeros(4, 4, 3, 24, device=DEVICE), torch.zeros(4, 4, 3, dv, device=DEVICE))
        for _ in range(2)
    ]
    args = (key.to(DEVICE), value.to(DEVICE))
    write_kv(*args, *caches[0], slots.to(DEVICE))
    write_kv_ref(*args, *caches[1], slots.to(DEVICE))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[0][1].flatten(0, 1)[12], value[3].to(DEVICE))


def test_mismatched_value_cache_raises_value_error():
    query, key_cache, value_cache, meta = make_batch([1], [5], 4, 2, 16, dv=32)
    with pytest.raises(ValueError, match="in blocks or heads"):
        paged_attention(query, key_cache, value_cache[:, :, :1], meta, 0.25)
    with pytest.raises(ValueError, match=r"out shape .* value head_dim"):
        paged_attention(query, key_cache, value_cache, meta, 0.25, out=torch.empty_like(query))
