"""The torch references (the CPU backend, and what the Triton kernels are held to) against dense
attention computed independently on contiguous tensors."""

from __future__ import annotations

import pytest
import torch
from hf_paged.kernels import paged_attention_ref, write_kv_ref

from hf_paged.worker.forward_context import AttentionMetadata


def _scatter_into_cache(seqs_k, seqs_v, block_size, num_blocks, seed=0):
    """Place each sequence's K/V in randomly chosen blocks; return caches and block tables."""
    g = torch.Generator().manual_seed(seed)
    hkv, d = seqs_k[0].shape[1:]
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=g)  # junk where nothing is written
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for k, v in zip(seqs_k, seqs_v):
        nb = -(-k.shape[0] // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        pos = torch.arange(k.shape[0])
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        write_kv_ref(k, v, kc, vc, slots)
        tables.append(blocks)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return kc, vc, table


def _dense(q, k, v, scale, window=None, softcap=None):
    """q [L, Hq, D] = last L positions of a sequence with keys k, v [S, Hkv, D]."""
    n_q, hq, _ = q.shape
    s, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(s - n_q, s)[:, None]
    kpos = torch.arange(s)[None, :]
    ok = kpos <= qpos
    if window:
        ok &= kpos > qpos - window
    scores = scores.masked_fill(~ok, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "seq_lens, q_lens, hq, hkv, window, softcap",
    [
        ([1, 5, 40], [1, 5, 40], 4, 4, None, None),  # prefill only
        ([9, 33, 70], [1, 1, 1], 8, 2, None, None),  # decode only, GQA 4
        ([50, 3, 64, 17], [10, 3, 1, 17], 7, 1, None, None),  # mixed, prefix + chunk, GQA 7
        ([60, 20], [25, 1], 4, 2, 16, None),  # sliding window
        ([30, 45], [30, 1], 4, 2, None, 2.0),  # softcap
    ],
)
def test_reference_equals_dense(seq_lens, q_lens, hq, hkv, window, softcap):
    torch.manual_seed(0)
    d, bs = 16, 8
    ks = [torch.randn(n, hkv, d) for n in seq_lens]
    vs = [torch.randn(n, hkv, d) for n in seq_lens]
    qs = [torch.randn(q, hq, d) for q in q_lens]
    kc, vc, table = _scatter_into_cache(ks, vs, bs, num_blocks=64)
    meta = AttentionMetadata.from_lengths(q_lens, seq_lens, table)
    out = paged_attention_ref(torch.cat(qs), kc, vc, meta, 0.3, window, softcap)
    ref = torch.cat([_dense(q, k, v, 0.3, window, softcap) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_write_kv_ref_skips_padding_slots():
    kc = torch.zeros(4, 2, 1, 3)
    vc = torch.zeros(4, 2, 1, 3)
    k = torch.arange(9.0).view(3, 1, 3)
    write_kv_ref(k, -k, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc[2, 1, 0], k[0, 0]) and torch.equal(vc[0, 0, 0], -k[2, 0])
    assert kc.abs().sum() == k[0].abs().sum() + k[2].abs().sum()


def test_float64_inputs_are_computed_in_float64():
    """Logits of ~60 (Gemma 4's unscaled attention): a float32 softmax would be off by ~1e-5
    relative; the reference keeps a float64 model's precision."""
    g = torch.Generator().manual_seed(0)
    s, hq, hkv, d, bs = 24, 4, 2, 16, 4
    k = torch.randn(s, hkv, d, generator=g, dtype=torch.float64) * 2.5
    v = torch.randn(s, hkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(s, hq, d, generator=g, dtype=torch.float64) * 2.5
    kc = torch.zeros(s // bs, bs, hkv, d, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    write_kv_ref(k, v, kc, vc, torch.arange(s))  # blocks 0.. in order
    table = torch.arange(s // bs, dtype=torch.int32)[None]
    meta = AttentionMetadata.from_lengths([s], [s], table)
    out = paged_attention_ref(q, kc, vc, meta, 1.0)
    assert out.dtype == torch.float64
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(hq // hkv, dim=1))
    assert float(scores.abs().max()) > 40
    assert torch.allclose(out, _dense(q, k, v, 1.0), atol=1e-12, rtol=0)
