"""Launch configuration of the paged-attention kernels, chosen from host ints only.

The tile shapes (AttentionConfig: decode_config, prefill_config, select_config) and the
flash-decoding split counts (choose_num_kv_splits, choose_decode_num_kv_splits), with the H200
measurements behind them. Kept apart from the kernels and launchers: both attention wrappers
(paged_attention, decode_attention) and the benchmark that tunes them
(evals/profiling/kernel_bench.py --sweep) read this one copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .host_math import cdiv, next_power_of_2


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tile shape and launch parameters. BLOCK_M = block_q * G rounded up to a power of 2."""

    block_m: int
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int
    one_tile_per_seq: bool  # decode-ish: every sequence's new tokens fit one q-tile


# Flash-decoding split heuristic, from H200 sweeps (evals/profiling/kernel_bench.py --sweep;
# Llama-3-8B heads, bf16, CUDA-graph timing): splitting pays while the grid is short of ~8
# (seq, kv head, split) programs per SM and each split streams >= ~512 keys (1 seq x 32k:
# 0.746 -> 0.056 ms with 32 splits; 16 x 8k: 0.225 -> 0.150 ms with 9). At 64 seqs it is
# neutral to slightly worse (64 x 2k: 0.146 ms unsplit, 0.155 with 3): a cut-off at ~2 programs
# per SM would be a little better there.
_SPLIT_TARGET_PROGRAMS_PER_SM = 8
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 32


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: any small number; tests force the split count explicitly
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_config(queries_per_kv: int, head_dim: int) -> AttentionConfig:
    """One token x the whole GQA group per program; tl.dot needs >= 16 rows."""
    block_m = max(16, next_power_of_2(queries_per_kv))
    # BLOCK_N 128: 98% of copy bandwidth at 64 x 8k on the H200, against 72-78% with 64 (sweep).
    block_n = 128 if head_dim <= 128 else 32
    return AttentionConfig(
        block_m,
        block_m // queries_per_kv,
        block_n,
        num_warps=4,
        num_stages=3,
        one_tile_per_seq=True,
    )


def prefill_config(queries_per_kv: int, head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """BLOCK_Q query tokens x the GQA group per program (FlashAttention-2-style tiles)."""
    if dtype == torch.float32:  # fp32 tiles are twice the bytes: halve them (not a fast path)
        block_m, block_n, warps, stages = 64, 32, 4, 2
    elif head_dim <= 128:
        # 128 x 128, 2 stages: 321 TFLOP/s at 8k on the H200, against 281 for 128 x 64 x 3.
        block_m, block_n, warps, stages = 128, 128, 8, 2
    else:  # head_dim 256: keep the accumulator and K/V stages within registers / shared memory
        block_m, block_n, warps, stages = 64, 32, 4, 2
    block_m = max(block_m, next_power_of_2(queries_per_kv))
    return AttentionConfig(
        block_m, block_m // queries_per_kv, block_n, warps, stages, one_tile_per_seq=False
    )


def select_config(
    max_query_len: int, queries_per_kv: int, head_dim: int, dtype: torch.dtype = torch.bfloat16
) -> AttentionConfig:
    """Tile shape for a batch from host ints only (no GPU sync)."""
    dec = decode_config(queries_per_kv, head_dim)
    if max_query_len <= dec.block_q:
        return dec
    return prefill_config(queries_per_kv, head_dim, dtype)


def choose_num_kv_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    device: torch.device,
    min_keys_per_split: int = _MIN_KEYS_PER_SPLIT,
) -> int:
    """Flash-decoding split count: enough programs to fill the GPU, enough keys per split
    (decode_attention asks for fewer keys per split: one tile)."""
    programs = max(1, num_seqs * num_kv_heads)
    target = _SPLIT_TARGET_PROGRAMS_PER_SM * num_sms(device)
    if programs >= target:
        return 1
    by_len = max(1, max_seq_len // min_keys_per_split)
    return max(1, min(cdiv(target, programs), by_len, _MAX_SPLITS))


def choose_decode_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device
) -> int:
    """decode_attention's split count: one key tile per split (at most 32 splits), since it reads
    each split's first tile before the PDL wait and the rest after it. H200, 1.1B shape, batch
    1, the whole step in one CUDA graph, 2026-11-29: 16 splits for
    max_model_len 2048, against choose_num_kv_splits' 4 (>= 512 keys each), save 2 us a layer
    at 640 keys and 5 at 1536, and nothing at 256; 32 cost ~0.7 us more than 16. But not where
    that grid would take more than half the SMs: Llama-3-8B (8 KV heads x 16 = 128 programs)
    fell from 222 to 202 tok/s (same machine and date), presumably
    because the o-projection's programs then find no room to load their weights during
    attention (not measured); there choose_num_kv_splits' count stays."""
    splits = choose_num_kv_splits(
        num_seqs, num_kv_heads, max_seq_len, device, min_keys_per_split=block_n
    )
    if num_seqs * num_kv_heads * splits > num_sms(device) // 2:
        splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_seq_len, device)
    return splits
