"""Paged attention over a flat batch that mixes prefill chunks and decodes."""

from __future__ import annotations

import torch

from hf_paged.forward_context import AttentionMetadata


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Pure-torch reference (and the CPU backend). One sequence at a time, softmax in float32.

    Semantics (the contract every kernel must match): the new tokens of sequence i are the last
    q_len of its seq_len tokens; new token at absolute position p attends to keys k <= p, and with
    a sliding window W only to keys k > p - W (W tokens including itself, as transformers does).
    Softcapping applies cap * tanh(score / cap) to the scaled scores before masking.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_host or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_host or meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_table[i, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        q = query[start:end].float()
        # [Hkv, G, q_len, D] x [Hkv, D, seq_len] -> [Hkv, G, q_len, seq_len]
        q = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(q, k.permute(1, 2, 0).unsqueeze(1)) * scale
        if softcap is not None and softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None and sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))  # [Hkv, G, q_len, D]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim).to(out.dtype)
    return out
