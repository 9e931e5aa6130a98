"""CUDA graphs of the whole model forward: pure-decode batches per batch-size bucket, and mixed
prefill/decode steps per token-count bucket.

A step launches hundreds of small kernels (22 layers x ~15 ops for a 1.1B Llama); replaying a
captured graph launches them all at once, so the step's cost is the GPU's, not Python's. Graph
inputs live in static buffers that each replay overwrites, and every launch grid is sized from
static numbers, so one graph serves every context length:

- Decode: a batch of B decodes is padded to the smallest bucket >= B. Padded rows write no K/V
  (slot -1) and attend to one token of block 0; their logits are dropped. The flash-decoding split
  is sized from max_model_len. After the logits each decode graph also takes every row's greedy
  token (kernels/argmax.py, the kernel the sampler's argmax uses on a GPU) into a static int64
  output, and in the same kernel writes it into the runner's last_tokens at the row's InputBatch
  row; padded rows have row -1 and write nothing, so they cannot clobber a real row's token.
  When every request of the step is plain greedy (no SamplingParams.features bits) the runner takes
  these tokens, and neither the sampler nor its last_tokens index_copy_ runs; the same kernel
  also writes them into pinned host memory (`host_tokens`), so no device-to-host copy follows
  the graph either. Why: at batch 1 on the H200 the argmax (4.4 us), the index_copy_ (1.8 us),
  the copy to the host (1.4 us), a second input copy and the gaps between them took ~26 us a
  step after the graph; with all of them inside it (argmax launched with PDL behind the lm_head
  GEMV) and the block table in the packed copy, ~9 us remain, and the 1.1B batch 1 went from
  1,352-1,359 to 1,391-1,397 tok/s (2026-11-30, interleaved A/B). A batch whose rows all sample in
  the sampling kernels draws in a sampling graph of its own (worker/decode_sampling.py); any
  other goes through the sampler. Either way an index_copy_ overwrites last_tokens for its
  rows after the graph (the in-graph writes are then only wasted stores). A decode graph whose
  block table is packed also moves its own inputs on by a token in that kernel, and the host
  skips the next step's copy when its inputs are exactly those (same rows, positions one
  further, same blocks): at batch 1 every step but about one in block_size
  (worker/graph_inputs.py).
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

Each graph reads its per-step inputs from views of one packed device buffer that the host fills
in one copy per step (worker/graph_inputs.py, PackedGraphInputs, where the layout and its
measurements are).

`eager=True` runs the same padded static buffers without capturing (CPU tests of the padding).
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
import torch

from hf_paged.worker.decode_sampling import DecodeSampling
from hf_paged.worker.forward_context import (
    AttentionMetadata,
    ForwardContext,
    PendingTokens,
    forward_context,
)
from hf_paged.worker.graph_inputs import GraphKey, PackedGraphInputs


def graph_buckets(max_batch_size: int, smallest: int = 1) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if smallest <= b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return sorted(sizes)


def token_buckets(max_tokens: int, small_rows: int = 0) -> list[int]:
    """Token counts of the mixed-step graphs: fine steps where steps are short and the host's
    launch cost matters most, coarser ones above (padding there is a smaller fraction).
    small_rows: the small-batch forward's largest step (0: none). Mixed steps of that many
    tokens or fewer get buckets of their own, 2, 4, ... up to it, whose graphs hold that
    forward, as decode steps of that many rows do. Its GEMVs compute rows one after another, so
    this pays at 2 rows (the default) and not at more: a 6-token verify step took ~18.7 ms
    through it against ~4.6 ms padded to the 32-token graph of transformers' forward (Llama-3-8B
    shape, H200, evals/profiling/spec_profile.py --small-batch-rows 8, 2026-12-02)."""
    if max_tokens < 1:
        return []
    sizes = {32, 64, 96, 128}
    size = 2
    while size < small_rows:
        sizes.add(size)
        size *= 2
    if small_rows >= 2:
        sizes.add(small_rows)
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
        smallest = 2 if runner.forward.compiled and runner.forward.small_batch is None else 1
        self.buckets = graph_buckets(max(self.max_batch_size, smallest), smallest)
        small = runner.forward.small_batch
        self.token_buckets = token_buckets(
            min(cfg.max_graph_tokens, cfg.max_num_batched_tokens),
            small.max_rows if small is not None else 0,
        )
        seqs = max(self.buckets[-1], self.max_num_seqs)
        dev = runner.device
        # decode: token i is sequence i, always
        self.decode_qsl = torch.arange(seqs + 1, dtype=torch.int32, device=dev)
        self.decode_keep = torch.arange(seqs, device=dev)
        keys = [("mixed", t) for t in self.token_buckets] + [("decode", b) for b in self.buckets]
        # each graph's sequence rows: a decode bucket's batch, a mixed bucket's kept rows
        rows = {
            (kind, size): size if kind == "decode" else self._kept_rows(size) for kind, size in keys
        }
        width = runner.input_batch.max_blocks_per_seq
        self.inputs = PackedGraphInputs(rows, width, dev, runner.block_size, lora=runner.lora)
        pin = dev.type == "cuda"
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        # Decode graphs take their greedy tokens inside (see the module docstring) with the
        # sampler's GPU argmax kernel. Off the GPU the kernel needs the interpreter.
        from hf_paged.kernels.kv_write import interpreting

        self.greedy_in_graph = dev.type == "cuda" or interpreting()
        self.greedy: dict[int, torch.Tensor] = {}  # decode bucket -> int64 [bucket], static
        # ... and the same tokens written by that kernel straight into pinned host memory (no
        # device-to-host copy after the graph: ~1.4 us plus the ~4 us gap before it, batch 1 on
        # the H200), into one of two rows, the packed input host_slot: step n+1 is launched
        # before the host reads step n's tokens (asynchronous scheduling), and step n+2 only
        # after, so two rows suffice. The host reads a row after the step's event.
        self.host_tokens = torch.zeros((2, self.buckets[-1]), dtype=torch.long, pin_memory=pin)
        self._landing = 0  # the landing row of the last decode replay
        # A decode graph whose block table is in its packed inputs also moves those inputs on by
        # one token (positions, sequence lengths, cache slots; kernels/argmax.py DecodeAdvance),
        # so the next step of the same rows at the next positions, with no new block, is sent
        # nothing (PackedGraphInputs.send_decode): at batch 1 that is every step but one in
        # block_size.
        self.advance = self.greedy_in_graph
        self.mixed_logits: torch.Tensor | None = None  # [max kept rows, vocab], shared
        self.replays = {"decode": 0, "mixed": 0}
        self.pool = None
        # decode steps whose rows all sample in the kernels draw in graphs of their own
        self.sampling = DecodeSampling(self)

    # -- what each graph computes -----------------------------------------------------------

    def _kept_rows(self, tokens: int) -> int:
        return min(tokens, self.max_num_seqs)

    def _context(self, kind: str, size: int) -> ForwardContext:
        v = self.inputs[(kind, size)]
        if kind == "decode":
            meta = AttentionMetadata(
                query_start_loc=self.decode_qsl[: size + 1],
                seq_lens=v["seq_lens"],
                block_table=self.inputs.block_table(("decode", size)),
                slot_mapping=v["slot_mapping"],
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
        else:
            meta = AttentionMetadata(
                query_start_loc=v["query_start_loc"],
                seq_lens=v["seq_lens"],
                block_table=self.inputs.block_table(("mixed", size)),
                slot_mapping=v["slot_mapping"],
                # the wrapper picks its launches from these two alone, so from the bucket: above
                # the decode tile, the two-launch path (grids from token and sequence counts)
                max_query_len=size,
                max_seq_len=self.max_model_len,
                min_query_len=None,  # so the decode-shaped launch always runs
            )
        ctx = ForwardContext(
            meta, self.runner.kv_caches, self.runner.backend, kv_scales=self.runner.kv_scales
        )
        if self.runner.lora:  # LoRA: each token's adapter slot, grouped by slot in the graph
            from hf_paged.kernels.lora import lora_segments
            from hf_paged.lora.batch import LoraBatch

            slots = v["lora_slots"]
            ctx.lora_groups = LoraBatch(slots, *lora_segments(slots, self.runner.config.max_loras))
        return ctx

    def _forward(self, kind: str, size: int) -> torch.Tensor:
        v = self.inputs[(kind, size)]
        # a token sampled by the step before is on the device only (asynchronous scheduling)
        ids = PendingTokens(v["input_ids"], v["pending"], v["rows"], self.runner.last_tokens)
        with forward_context(self._context(kind, size)):
            if kind == "decode":  # every token keeps its logits row: a static arange
                logits = self.runner.forward(ids, v["positions"], self.decode_keep[:size])
                if self.greedy_in_graph:
                    self.greedy[size] = self._greedy(logits, v, size)
                return logits
            rows = self._kept_rows(size)
            logits = self.runner.forward(ids, v["positions"], v["keep"])
            if self.mixed_logits is None:  # first (largest) capture: the shared output buffer
                self.mixed_logits = torch.empty(
                    (rows, logits.shape[-1]), dtype=logits.dtype, device=logits.device
                )
            self.mixed_logits[:rows].copy_(logits)
            return self.mixed_logits[:rows]

    def _greedy(self, logits: torch.Tensor, v: dict, size: int) -> torch.Tensor:
        """Each row's greedy token, also written into last_tokens[rows] (padding: row -1, no
        write) and into host_tokens[host_slot]. Launched with PDL only behind the small-batch
        forward's PDL chain, whose lm_head GEMV lets it start early; after a compiled forward
        there is no early trigger to use."""
        from hf_paged.kernels import argmax_rows
        from hf_paged.kernels.argmax import DecodeAdvance

        sb = self.runner.forward.small_batch
        pdl = sb is not None and sb.pdl and size <= sb.max_rows
        advance = None
        if self._advances(size):
            advance = DecodeAdvance(
                v["positions"], v["seq_lens"], v["slot_mapping"], v["block_table"],
                v["sent_pos"], self.runner.block_size, v["input_ids"],
            )  # fmt: skip
        return argmax_rows(
            logits,
            scatter=(self.runner.last_tokens, v["rows"]),
            host=(self.host_tokens, v["host_slot"]),
            advance=advance,
            pdl=pdl,
        )

    def _advances(self, size: int) -> bool:
        """Whether the decode graph of this bucket moves its own inputs on (see __init__)."""
        return self.advance and self.inputs.packs_table(("decode", size))

    def _order(self) -> list[tuple[str, int]]:
        """Largest first, mixed steps first (their activations are the largest): smaller graphs
        reuse the memory pool of larger ones."""
        order = [("mixed", t) for t in reversed(self.token_buckets)]
        return order + [("decode", b) for b in reversed(self.buckets)]

    @torch.inference_mode()
    def forward_each_bucket(self) -> None:
        """One eager forward of each bucket, as capture() runs it: start-up records the Triton
        variants the captures need this way and compiles them ahead (worker/compile_ahead.py)."""
        if self.eager:
            return
        for kind, size in self._order():
            self.inputs.reset_padding((kind, size))
            self._forward(kind, size)
        torch.cuda.synchronize(self.runner.device)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool (mixed
        steps first: their activations are the largest). The static buffers hold padding values
        during capture (slot -1, empty sequences): nothing is written. One eager forward of a
        bucket before its capture does what must not happen inside one (lazy initialisation,
        cuBLAS workspaces, a Triton variant's first launch); a second one, as the capture ran
        before, cost the Llama-3-8B shape's start-up ~1 s on the H200 and changed nothing."""
        if self.eager:
            return
        for kind, size in self._order():
            self.inputs.reset_padding((kind, size))
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

    def _replay(self, kind: str, size: int) -> torch.Tensor:
        self.replays[kind] += 1
        if self.eager:
            return self._forward(kind, size)
        self.graphs[(kind, size)].replay()
        return self.outputs[(kind, size)]

    # -- per step -------------------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int:
        i = bisect_left(self.buckets, batch)  # buckets are sorted: no loop over them per step
        if i == len(self.buckets):
            raise ValueError(
                f"batch {batch} exceeds the largest CUDA graph ({self.max_batch_size})"
            )
        return self.buckets[i]

    def token_bucket_for(self, num_tokens: int) -> int | None:
        """The mixed-step graph for a flat batch of num_tokens, or None (run it eagerly)."""
        i = bisect_left(self.token_buckets, num_tokens)
        return self.token_buckets[i] if i < len(self.token_buckets) else None

    def run(self, step) -> torch.Tensor:
        """Replay for a decode-only step; returns logits [B, vocab] (a view of the graph output)."""
        batch = len(step.rows)
        padded = self.bucket_for(batch)
        self._landing ^= 1
        self.inputs.send_decode(
            step, ("decode", padded), self._step_table(step), self._landing, self._advances(padded)
        )
        return self._replay("decode", padded)[:batch]

    def decode_again(self, step, n: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """n more replays of the decode graph run(step) just replayed, each on the inputs the
        one before moved on (positions, cache slots, and each row's input token: the greedy
        token the replay before wrote into last_tokens): the rows' tokens of run(step) and of
        the n replays, int64 [n + 1, batch] on the device (written into `out` when given),
        with no host work but the launches (the draft model's proposals:
        spec_decode/draft_model.py). None where the graph does not move its inputs on, a row's
        input token came from the host, or the new positions leave the block table columns
        sent; the caller then runs steps as usual."""
        batch = len(step.rows)
        padded = self.bucket_for(batch)
        if not self._advances(padded) or not self.inputs.holds_run(step, n):
            return None
        if out is None:
            out = torch.empty((n + 1, batch), dtype=torch.long, device=self.runner.device)
        out[0].copy_(self.greedy[padded][:batch])
        for j in range(1, n + 1):
            self._landing ^= 1  # the landing row alternates with each replay, as in run()
            self._replay("decode", padded)
            out[j].copy_(self.greedy[padded][:batch])  # (eager: a new tensor each forward)
        self.inputs.moved_on(n)
        return out

    def decode_rows(self, batch: int) -> torch.Tensor:
        """The InputBatch rows of a decode step of `batch` sequences, on the device (its graph's
        packed inputs): where run() put them, until the next step's copy."""
        return self.inputs[("decode", self.bucket_for(batch))]["rows"][:batch]

    def greedy_tokens(self, batch: int) -> torch.Tensor | None:
        """The greedy token of each row of the decode step run() just replayed, int64 [batch] (a
        view of the graph's static output: the next replay overwrites it), already written into
        the runner's last_tokens at the rows' InputBatch rows; None where the graphs do not take
        greedy tokens (greedy_in_graph)."""
        if not self.greedy_in_graph:
            return None
        return self.greedy[self.bucket_for(batch)][:batch]

    def greedy_host(self, batch: int) -> torch.Tensor:
        """Where the decode step run() just replayed writes its greedy tokens on the host: a
        view of a pinned row, valid once the step's work has finished (an event after it), and
        until the step after next overwrites it."""
        return self.host_tokens[self._landing, :batch]

    def run_mixed(self, step, keep: np.ndarray) -> torch.Tensor:
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
        self.inputs.send(step, ("mixed", padded), num_tokens, self._step_table(step), keep=keep)
        return self._replay("mixed", padded)[:num_keep]

    def _step_table(self, step) -> np.ndarray:
        """The step's block table rows, their used columns (host)."""
        return self.runner.input_batch.block_table[step.rows, : step.max_blocks]
