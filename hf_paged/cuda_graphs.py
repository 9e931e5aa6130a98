"""CUDA graphs of the whole model forward for pure-decode batches, one per batch-size bucket.

A decode step launches hundreds of small kernels (22 layers x ~15 ops for a 1.1B Llama); replaying
a captured graph launches them all at once, so the step's cost is the GPU's, not Python's.
A batch of B decodes is padded to the smallest bucket >= B: padded rows write no K/V (slot -1) and
attend to one token of block 0; their logits are dropped. Graph inputs live in static buffers
that each replay overwrites; the attention grid is sized from max_model_len, which is static, so
one graph serves every context length.
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


class CudaGraphRunner:
    # inference tensors, as a step's inputs are: dynamo guards on the dispatch keys
    @torch.inference_mode()
    def __init__(self, runner) -> None:
        cfg = runner.config
        self.runner = runner
        self.max_model_len = cfg.max_model_len
        self.max_batch_size = min(cfg.max_num_seqs, cfg.max_graph_batch_size)
        # A compiled model specialises a batch of 1 (a second whole-model compile): pad it to 2.
        smallest = 2 if runner.compiled else 1
        self.buckets = graph_buckets(max(self.max_batch_size, smallest), smallest)
        n, dev = self.buckets[-1], runner.device
        width = runner.input_batch.max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((n, width), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _context(self, batch: int) -> ForwardContext:
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_table=self.block_table[:batch],
            slot_mapping=self.slot_mapping[:batch],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        return ForwardContext(meta, self.runner.kv_caches, self.runner.backend)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool. The
        static buffers hold padding values (slot -1) during capture: nothing is written."""
        forward = self.runner._forward_all
        for batch in reversed(self.buckets):
            with forward_context(self._context(batch)):
                for _ in range(2):  # warm-up: autotuning, lazy init, compilation
                    forward(self.input_ids[:batch], self.positions[:batch])
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = forward(self.input_ids[:batch], self.positions[:batch])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
            self.outputs[batch] = out
        torch.cuda.synchronize(self.runner.device)

    def bucket_for(self, batch: int) -> int:
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"batch {batch} exceeds the largest CUDA graph ({self.max_batch_size})")

    def run(self, step, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay for a decode-only step; returns logits [B, vocab] (a view of the graph output).
        input_ids: the step's ids already on the device (asynchronous scheduling), else taken
        from step.input_ids on the host."""
        batch = len(step.rows)
        padded = self.bucket_for(batch)
        dev = self.runner.device
        if input_ids is not None:
            self.input_ids[:batch].copy_(input_ids)
        else:
            self.input_ids[:batch].copy_(pinned(step.input_ids, dev), non_blocking=True)
        self.positions[:batch].copy_(pinned(step.positions, dev), non_blocking=True)
        self.slot_mapping[:batch].copy_(pinned(step.slot_mapping, dev), non_blocking=True)
        self.seq_lens[:batch].copy_(pinned(step.seq_lens.astype(np.int32), dev), non_blocking=True)
        table = self.runner.input_batch.block_table[step.rows, : step.max_blocks]
        self.block_table[:batch, : step.max_blocks].copy_(pinned(table, dev), non_blocking=True)
        if padded > batch:
            self.slot_mapping[batch:padded].fill_(-1)
            self.seq_lens[batch:padded].fill_(1)
        self.graphs[padded].replay()
        return self.outputs[padded][:batch]
