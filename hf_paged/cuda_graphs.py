"""CUDA graphs of the whole model forward: pure-decode batches per batch-size bucket, and mixed
prefill/decode steps per token-count bucket.

A step launches hundreds of small kernels (22 layers x ~15 ops for a 1.1B Llama); replaying a
captured graph launches them all at once, so the step's cost is the GPU's, not Python's. Graph
inputs live in static buffers that each replay overwrites, and every launch grid is sized from
static numbers, so one graph serves every context length:

- Decode: a batch of B decodes is padded to the smallest bucket >= B. Padded rows write no K/V
  (slot -1) and attend to one token of block 0; their logits are dropped. The flash-decoding split
  is sized from max_model_len.
- Mixed (any step with a prompt chunk or a multi-token query): the flat batch of T tokens is
  padded to the smallest token bucket >= T and its sequences to min(bucket, max_num_seqs) with
  empty ones (no new tokens: their attention programs exit at once). Padded tokens belong to no
  sequence: they write no K/V and attention zero-fills their rows. The attention wrapper sees a
  max_query_len above the decode tile and no min_query_len, so it always takes its two-launch
  path (prefill-shaped tiles, then decode-shaped tiles), whose grids depend only on the bucket.
  Logits are kept for up to min(bucket, max_num_seqs) rows and copied into one buffer that every
  mixed graph shares. Why whole-forward graphs rather than vLLM's piecewise ones (attention run
  eagerly between captured pieces): our attention kernels already take every per-step number
  from device memory, so nothing has to stay outside the graph, and the host launches nothing
  per layer. On the H200 (Llama-3-8B shape, ShareGPT lengths) mixed steps ran at ~42 ms of wall
  for ~19 ms of GPU work when launched op by op.

`eager=True` runs the same padded static buffers without capturing (CPU tests of the padding).
"""

from __future__ import annotations

import numpy as np
import torch

from hf_paged.forward_context import AttentionMetadata, ForwardContext, forward_context
from hf_paged.host_to_device import pinned


def graph_buckets(max_batch_size: int, smallest: int = 1) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if smallest <= b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return sorted(sizes)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts of the mixed-step graphs: fine steps where steps are short and the host's
    launch cost matters most, coarser ones above (padding there is a smaller fraction)."""
    if max_tokens < 1:
        return []
    sizes = {32, 64, 96, 128}
    sizes.update(range(192, 513, 64))
    sizes.update(range(640, 1025, 128))
    sizes.update(range(1280, max_tokens + 1, 256))
    sizes = {s for s in sizes if s <= max_tokens}
    sizes.add(max_tokens)
    return sorted(sizes)


class CudaGraphRunner:
    # inference tensors, as a step's inputs are: dynamo guards on the dispatch keys
    @torch.inference_mode()
    def __init__(self, runner, eager: bool = False) -> None:
        cfg = runner.config
        self.runner = runner
        self.eager = eager
        self.max_model_len = cfg.max_model_len
        self.max_num_seqs = cfg.max_num_seqs
        self.max_batch_size = min(cfg.max_num_seqs, cfg.max_graph_batch_size)
        # A compiled model specialises a batch of 1 (a second whole-model compile): pad it to 2,
        # unless the small-batch forward (no dynamo) runs batch 1.
        smallest = 2 if runner.compiled and runner.small_batch is None else 1
        self.buckets = graph_buckets(max(self.max_batch_size, smallest), smallest)
        self.token_buckets = token_buckets(min(cfg.max_graph_tokens, cfg.max_num_batched_tokens))
        n = max(self.buckets[-1], self.token_buckets[-1] if self.token_buckets else 0)
        seqs = max(self.buckets[-1], self.max_num_seqs)
        dev = runner.device
        width = runner.input_batch.max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(seqs, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((seqs, width), dtype=torch.int32, device=dev)
        # decode: token i is sequence i, always; mixed: rewritten each step
        self.decode_qsl = torch.arange(seqs + 1, dtype=torch.int32, device=dev)
        self.mixed_qsl = torch.zeros(seqs + 1, dtype=torch.int32, device=dev)
        self.keep = torch.zeros(n, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.mixed_logits: torch.Tensor | None = None  # [max kept rows, vocab], shared
        self.replays = {"decode": 0, "mixed": 0}
        self.pool = None

    # -- what each graph computes -----------------------------------------------------------

    def _kept_rows(self, tokens: int) -> int:
        return min(tokens, self.max_num_seqs)

    def _context(self, kind: str, size: int) -> ForwardContext:
        if kind == "decode":
            meta = AttentionMetadata(
                query_start_loc=self.decode_qsl[: size + 1],
                seq_lens=self.seq_lens[:size],
                block_table=self.block_table[:size],
                slot_mapping=self.slot_mapping[:size],
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
        else:
            seqs = self._kept_rows(size)
            meta = AttentionMetadata(
                query_start_loc=self.mixed_qsl[: seqs + 1],
                seq_lens=self.seq_lens[:seqs],
                block_table=self.block_table[:seqs],
                slot_mapping=self.slot_mapping[:size],
                # the wrapper picks its launches from these two alone, so from the bucket: above
                # the decode tile, the two-launch path (grids from token and sequence counts)
                max_query_len=size,
                max_seq_len=self.max_model_len,
                min_query_len=None,  # so the decode-shaped launch always runs
            )
        return ForwardContext(meta, self.runner.kv_caches, self.runner.backend)

    def _forward(self, kind: str, size: int) -> torch.Tensor:
        with forward_context(self._context(kind, size)):
            if kind == "decode":
                return self.runner._forward_all(self.input_ids[:size], self.positions[:size])
            rows = self._kept_rows(size)
            logits = self.runner._forward(
                self.input_ids[:size], self.positions[:size], self.keep[:rows]
            )
            if self.mixed_logits is None:  # first (largest) capture: the shared output buffer
                self.mixed_logits = torch.empty(
                    (rows, logits.shape[-1]), dtype=logits.dtype, device=logits.device
                )
            self.mixed_logits[:rows].copy_(logits)
            return self.mixed_logits[:rows]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool (mixed
        steps first: their activations are the largest). The static buffers hold padding values
        during capture (slot -1, empty sequences): nothing is written."""
        self._reset_padding()
        if self.eager:
            return
        order = [("mixed", t) for t in reversed(self.token_buckets)]
        order += [("decode", b) for b in reversed(self.buckets)]
        for kind, size in order:
            for _ in range(2):  # warm-up: autotuning, lazy init, compilation
                self._forward(kind, size)
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(kind, size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(kind, size)] = graph
            self.outputs[(kind, size)] = out
        torch.cuda.synchronize(self.runner.device)

    def _reset_padding(self) -> None:
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.mixed_qsl.zero_()
        self.keep.zero_()

    def _replay(self, kind: str, size: int) -> torch.Tensor:
        self.replays[kind] += 1
        if self.eager:
            return self._forward(kind, size)
        self.graphs[(kind, size)].replay()
        return self.outputs[(kind, size)]

    # -- per step -------------------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int:
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"batch {batch} exceeds the largest CUDA graph ({self.max_batch_size})")

    def token_bucket_for(self, num_tokens: int) -> int | None:
        """The mixed-step graph for a flat batch of num_tokens, or None (run it eagerly)."""
        for size in self.token_buckets:
            if size >= num_tokens:
                return size
        return None

    def _copy_common(self, step, input_ids: torch.Tensor | None, count: int) -> None:
        dev = self.runner.device
        if input_ids is not None:
            self.input_ids[:count].copy_(input_ids)
        else:
            self.input_ids[:count].copy_(pinned(step.input_ids, dev), non_blocking=True)
        self.positions[:count].copy_(pinned(step.positions, dev), non_blocking=True)
        self.slot_mapping[:count].copy_(pinned(step.slot_mapping, dev), non_blocking=True)
        batch = len(step.rows)
        self.seq_lens[:batch].copy_(pinned(step.seq_lens.astype(np.int32), dev), non_blocking=True)
        table = self.runner.input_batch.block_table[step.rows, : step.max_blocks]
        self.block_table[:batch, : step.max_blocks].copy_(pinned(table, dev), non_blocking=True)

    def run(self, step, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay for a decode-only step; returns logits [B, vocab] (a view of the graph output).
        input_ids: the step's ids already on the device (asynchronous scheduling), else taken
        from step.input_ids on the host."""
        batch = len(step.rows)
        padded = self.bucket_for(batch)
        self._copy_common(step, input_ids, batch)
        if padded > batch:
            self.slot_mapping[batch:padded].fill_(-1)
            self.seq_lens[batch:padded].fill_(1)
        return self._replay("decode", padded)[:batch]

    def run_mixed(
        self, step, keep: np.ndarray, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Replay for a mixed step that token_bucket_for() fits; returns logits for the flat
        token indices `keep` (at most max_num_seqs of them), in order."""
        num_tokens = int(step.qsl[-1])
        padded = self.token_bucket_for(num_tokens)
        rows = self._kept_rows(padded or 0)
        num_seqs, num_keep = len(step.rows), len(keep)
        if padded is None or num_seqs > rows or num_keep > rows:
            raise ValueError(
                f"mixed step of {num_tokens} tokens, {num_seqs} sequences and {num_keep} kept "
                f"rows does not fit a graph (token buckets up to {self.token_buckets[-1:]})"
            )
        dev = self.runner.device
        self._copy_common(step, input_ids, num_tokens)
        # padding: tokens past the real ones write nothing and belong to no sequence; sequences
        # past the real ones are empty (their query start is the end of the real tokens)
        qsl = np.full(rows + 1, num_tokens, dtype=np.int32)
        qsl[: num_seqs + 1] = step.qsl
        keep_rows = np.zeros(rows, dtype=np.int64)
        keep_rows[:num_keep] = keep
        self.mixed_qsl[: rows + 1].copy_(pinned(qsl, dev), non_blocking=True)
        self.keep[:rows].copy_(pinned(keep_rows, dev), non_blocking=True)
        if padded > num_tokens:
            self.slot_mapping[num_tokens:padded].fill_(-1)
        return self._replay("mixed", padded)[:num_keep]
