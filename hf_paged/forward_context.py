"""The per-step attention metadata and the forward context that carries it to every layer.

The forward context is the engine's only global: the model runner enters it around one model
forward, and the registered attention function (hf_paged.attention) reads it in every layer.
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

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key, value) [N, B, Hkv, D]
    backend: object  # hf_paged.attention.AttentionBackend


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
