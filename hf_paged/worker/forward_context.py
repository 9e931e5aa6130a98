"""The per-step attention metadata and the forward context that carries it to every layer.

The forward context is the engine's only global: the model runner enters it around one model
forward, and the registered attention function (hf_paged.worker.attention) reads it in every layer.
Outside a context the patched model behaves like plain transformers (sdpa).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """What one step's flat token batch looks like to attention. Built once per step.

    Sequence i owns the new tokens query_start_loc[i]:query_start_loc[i+1] of the flat batch; they
    are its last q_len_i = query_start_loc[i+1]-query_start_loc[i] tokens, so new token j sits at
    absolute position seq_lens[i] - q_len_i + j and attends to keys 0..position (causal among the
    new tokens, full over the cached prefix), within sliding_window if one is given.
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs], cached + new tokens after this step
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], physical block ids
    slot_mapping: torch.Tensor  # int64 [num_tokens], block_id * block_size + offset; -1 = no write
    max_query_len: int
    max_seq_len: int
    # Host copies (lists) for the torch backend, which loops over sequences; kernels ignore them.
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # Fewest new tokens of any sequence, known on the host once per step: the Triton wrapper skips
    # its decode-shaped launch when no query is short (None: assume some are).
    min_query_len: int | None = None

    @classmethod
    def from_lengths(
        cls,
        q_lens: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        *,
        num_tokens: int | None = None,
        host_lists: bool = True,
    ) -> AttentionMetadata:
        """Metadata for sequences with these new-token and context lengths, on block_table's
        device (profiling runs, tests, benchmarks). slot_mapping is all -1 (no K/V writes) over
        num_tokens (default sum(q_lens)); host_lists=False leaves the host copies (and
        min_query_len) out."""
        device = block_table.device
        qsl = [0]
        for q_len in q_lens:
            qsl.append(qsl[-1] + q_len)
        num_tokens = qsl[-1] if num_tokens is None else num_tokens
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=block_table.to(torch.int32),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            max_query_len=max(q_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_host=qsl if host_lists else None,
            seq_lens_host=list(seq_lens) if host_lists else None,
            min_query_len=min(q_lens, default=0) if host_lists else None,
        )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass(slots=True)
class PendingTokens:
    """A step's input ids when some were sampled by the step before and are on the device only
    (asynchronous scheduling): token t is last_tokens[rows[t]] where pending[t], else
    input_ids[t]. The small-batch forward resolves them inside its embedding kernel; any other
    forward calls resolve() first."""

    input_ids: torch.Tensor  # int64 [T], from the host
    pending: torch.Tensor  # bool [T]
    rows: torch.Tensor  # int64 [T], InputBatch rows
    last_tokens: torch.Tensor  # int64 [max_num_seqs], the runner's last sampled token per row

    def resolve(self) -> torch.Tensor:
        return torch.where(self.pending, self.last_tokens[self.rows], self.input_ids)


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key, value) [N, B, Hkv, D]
    backend: object  # hf_paged.worker.attention.AttentionBackend
    # LoRA (hf_paged.lora.batch.LoraBatch): each token's adapter slot; None when no token of
    # the step has an adapter
    lora_groups: object | None = None
    # FP8 KV caches: (k_scale, v_scale) per layer, each a float or one per KV head
    # (hf_paged/quantization/kv_cache.py)
    kv_scales: list[tuple] | None = None
    # int64 [T]: each token's position in its sequence, set by ModelForward for the step (read
    # by positional embeddings that build positions from the flat batch's length otherwise)
    positions: torch.Tensor | None = None


_CONTEXT: ForwardContext | None = None
# A plain bool beside the context: torch.compile guards on its value (one compiled graph for engine
# steps) instead of on the identity of the per-step context object (a recompile every step).
_ACTIVE = False


def get_forward_context() -> ForwardContext | None:
    return _CONTEXT


def in_engine_step() -> bool:
    return _ACTIVE


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CONTEXT, _ACTIVE
    prev, _CONTEXT = _CONTEXT, ctx
    prev_active, _ACTIVE = _ACTIVE, True
    try:
        yield ctx
    finally:
        _CONTEXT, _ACTIVE = prev, prev_active
