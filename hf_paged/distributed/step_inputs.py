"""One forward's inputs, from rank 0 to the other ranks: a small header through each worker's
pipe (sizes and host integers), then every tensor packed into one int64 buffer and broadcast once
(device to device under NCCL: input ids sampled on the device by the step before never visit the
host)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.distributed import collectives
from hf_paged.worker.forward_context import AttentionMetadata


@dataclass(frozen=True, slots=True)
class StepHeader:
    num_tokens: int
    num_keep: int
    num_seqs: int
    table_width: int
    max_query_len: int
    max_seq_len: int
    min_query_len: int | None
    host_lists: bool  # the torch backend reads the metadata's host copies


def send_forward(
    ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, meta: AttentionMetadata
) -> tuple[StepHeader, torch.Tensor]:
    """The header for the pipes and the packed buffer, already broadcast (rank 0's side; the
    header must reach the workers first: callers send it, then call collectives.broadcast)."""
    header = StepHeader(
        ids.shape[0],
        keep.shape[0],
        meta.num_seqs,
        meta.block_table.shape[1],
        meta.max_query_len,
        meta.max_seq_len,
        meta.min_query_len,
        meta.query_start_loc_host is not None,
    )
    packed = torch.cat(
        [
            ids.long(),
            positions.long(),
            keep.long(),
            meta.query_start_loc.long(),
            meta.seq_lens.long(),
            meta.block_table.long().flatten(),
            meta.slot_mapping.long(),
        ]
    )
    return header, packed


def receive_forward(header: StepHeader, device: torch.device):
    """(ids, positions, keep, AttentionMetadata) broadcast by rank 0 for this header."""
    h = header
    sizes = [
        h.num_tokens,
        h.num_tokens,
        h.num_keep,
        h.num_seqs + 1,
        h.num_seqs,
        h.num_seqs * h.table_width,
        h.num_tokens,
    ]
    packed = torch.empty(sum(sizes), dtype=torch.long, device=device)
    collectives.broadcast(packed)
    ids, positions, keep, qsl, seq_lens, table, slots = packed.split(sizes)
    meta = AttentionMetadata(
        query_start_loc=qsl.int(),
        seq_lens=seq_lens.int(),
        block_table=table.view(h.num_seqs, h.table_width).int(),
        slot_mapping=slots.contiguous(),
        max_query_len=h.max_query_len,
        max_seq_len=h.max_seq_len,
        query_start_loc_host=qsl.tolist() if h.host_lists else None,
        seq_lens_host=seq_lens.tolist() if h.host_lists else None,
        min_query_len=h.min_query_len,
    )
    return ids.contiguous(), positions.contiguous(), keep.contiguous(), meta
