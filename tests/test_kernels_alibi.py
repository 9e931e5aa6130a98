"""ALiBi in the paged-attention kernel against paged_attention_ref, and the reference against
Bloom's formula (scores + slope * key position over a causal mask). Interpreted on CPU (tests/
conftest.py sets TRITON_INTERPRET=1 without a GPU); real shapes on the GPU are marked gpu."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.test_kernels_attention_features import DEVICE, TOL, AttentionConfig, make_batch

pa_mod = importlib.import_module("hf_paged.kernels.paged_attention")
paged_attention, paged_attention_ref = pa_mod.paged_attention, pa_mod.paged_attention_ref


def slopes_for(num_q_heads: int) -> torch.Tensor:
    # Bloom's geometric slopes (2^(-8/H) ... 2^-8) scaled up: steep enough that a wrong sign or
    # a position off by one moves the output well past the tolerance
    exps = torch.arange(1, num_q_heads + 1, dtype=torch.float32)
    return (4.0 * 2.0 ** (-8.0 * exps / num_q_heads)).to(DEVICE)


def test_reference_alibi_matches_bloom_formula():
    """One sequence, no cache prefix: softmax(scale * q.k + slope * k_pos, causal) V."""
    query, key_cache, value_cache, meta = make_batch([12], [12], 4, 4, 16)
    slopes = slopes_for(4)
    ref = paged_attention_ref(query, key_cache, value_cache, meta, 0.25, alibi_slopes=slopes)
    blocks = meta.block_table[0, :1].long()
    k = key_cache[blocks].reshape(-1, 4, 16)[:12].float()
    v = value_cache[blocks].reshape(-1, 4, 16)[:12].float()
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * 0.25
    scores = scores + slopes[:, None, None] * torch.arange(12, device=DEVICE).float()
    causal = torch.ones(12, 12, dtype=torch.bool, device=DEVICE).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(ref, torch.einsum("hqk,khd->qhd", probs, v))
    # and it matters: without the slopes the output differs
    plain = paged_attention_ref(query, key_cache, value_cache, meta, 0.25)
    assert (plain - ref).abs().max() > 1e-2


def check_alibi(q_lens, seq_lens, hq, hkv, d, dtype=torch.float32, **kw):
    query, key_cache, value_cache, meta = make_batch(q_lens, seq_lens, hq, hkv, d, dtype)
    slopes = slopes_for(hq)
    window, softcap = kw.pop("sliding_window", None), kw.pop("softcap", None)
    out = paged_attention(
        query, key_cache, value_cache, meta, d**-0.5, window, softcap, alibi_slopes=slopes, **kw
    )
    ref = paged_attention_ref(
        query, key_cache, value_cache, meta, d**-0.5, window, softcap, alibi_slopes=slopes
    )
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_alibi_mixed_prefill_and_decode():
    check_alibi([1, 20, 3, 1], [9, 20, 40, 70], 4, 2, 32)


@pytest.mark.parametrize("splits", [2, 3])
def test_alibi_split_kv(splits):
    check_alibi([1, 1, 1], [3, 60, 150], 8, 2, 16, num_kv_splits=splits)


def test_alibi_small_tiles_many_edges_and_window_bf16():
    cfg = AttentionConfig(32, 8, 16, 4, 1, False)  # 8 tokens x 4 query heads a tile
    check_alibi([7, 13], [30, 13], 8, 2, 16, config=cfg)
    check_alibi([1, 17], [50, 40], 4, 1, 16, torch.bfloat16, sliding_window=8)


def test_bad_slopes_raise_value_error():
    query, key_cache, value_cache, meta = make_batch([3], [3], 4, 2, 16)
    with pytest.raises(ValueError, match=r"alibi_slopes must be \[num_q_heads=4\]"):
        paged_attention(
            query, key_cache, value_cache, meta, 0.25, alibi_slopes=torch.ones(2).to(DEVICE)
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alibi_real_shapes_gpu(dtype):
    # Bloom-7B's heads (32 x 128, MHA), MPT-7B's the same: a long prefill, a chunk over a
    # cached prefix and decodes with flash-decoding splits
    check_alibi([1, 1, 700, 256, 1], [4000, 33, 700, 1800, 9000], 32, 32, 128, dtype)
    check_alibi([1] * 8, [100, 2000, 5000, 8000, 1, 17, 4096, 300], 32, 32, 128, dtype)
