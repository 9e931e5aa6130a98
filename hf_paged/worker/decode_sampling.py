"""Sampling of a decode graph's rows inside CUDA graphs of their own, one per (bucket, kernel).

Why: a decode step whose rows all sample (temperature / top-k / top-p / min-p) used to leave the
graph for the sampler, which rebuilt its parameter rows on the host, copied them, drew the
uniforms and launched torch.topk and the sampling kernel one by one every step: host work and
launches that a plain greedy step (its argmax inside the decode graph) does not have. Here the
draw of such a step is one more graph replay: the per-row parameters sit in a static device
buffer, sent only when the step's rows change (a new request, a finished one: not in the steady
decode), and the unseeded rows' uniforms are drawn inside the graph from torch's default CUDA
generator (graph-safe: each replay advances its Philox offset, so runs still follow
torch.manual_seed). A seeded row's uniform still comes from its own generator, as in the sampler
(hf_paged/sample/sampler.py draw_fast), and overrides the graph's through the same buffer, so its
tokens do not depend on the batch.

The draw is the one the sampler runs for these rows: kernels/sampling_topk.py when every row's
top_k fits a candidate list (the list length of the largest one picks the graph), else
kernels/sampling.py when none does; a batch with both kinds, or with any row that needs more than
the kernels (greedy rows, bans, processors, typical-p, records, grammars, forks, beams), goes
through the sampler as before. Repetition, presence and frequency penalties run inside the graph,
before the draw, from device-resident token counts (worker/decode_penalties.py). A graph is
captured the first time its (bucket, kernel, penalty pool tensors) is used, after that step has
been drawn eagerly (the draw also compiles the kernel variant).
`eager` (CudaGraphRunner(eager=True), the CPU tests) runs the same code without capture.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_paged.sample.metadata import SamplingRow
from hf_paged.sample.token_counts import TokenCountPool
from hf_paged.sampling_params import F_RENORM, F_WARP
from hf_paged.worker.decode_penalties import PENALTIES, GraphPenalties
from hf_paged.worker.host_to_device import to_device

# the parameter buffer's rows; padded rows (bucket > batch) draw with harmless values
_TEMP, _TOP_K, _TOP_P, _MIN_P, _U_SEEDED, _SEEDED = range(6)
_PADDING = (1.0, 1.0, 1.0, 0.0, 0.0, 0.0)


def graph_kernel(rows: list[SamplingRow], vocab: int) -> int | None:
    """Which graph draws these rows: the candidate list length of kernels/sampling_topk.py, 0 for
    kernels/sampling.py, or None when some row needs the sampler (see the module docstring)."""
    from hf_paged.kernels.sampling_topk import TOPK_CAP, list_length

    short = 0
    k_max = 0
    for r in rows:
        p = r.params
        feats = r.features
        if feats & ~(F_WARP | F_RENORM | PENALTIES) or not feats & F_WARP or p.typical_p != 1.0:
            return None
        if 0 < p.top_k <= TOPK_CAP and list_length(p.top_k) <= vocab:
            short += 1
            k_max = max(k_max, p.top_k)
    if short == len(rows):
        return list_length(k_max)
    return 0 if short == 0 else None


class DecodeSampling:
    """draw(logits, rows, key) -> int64 tokens [batch] for a decode step just replayed, or None
    when its rows need the sampler."""

    def __init__(self, graphs) -> None:
        self.graphs = graphs
        dev = graphs.runner.device
        self.device = dev
        width = -(-graphs.buckets[-1] // 4) * 4  # rows on 16-byte boundaries (Triton's key)
        self.params = torch.zeros((len(_PADDING), width), dtype=torch.float32, device=dev)
        self.penalties = GraphPenalties(width, dev)
        # (bucket, kernel, the penalty pool's tensors or None) -> graph, its tokens
        self.captured: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # draws made here (tests count them)
        self._key: tuple[bytes, bytes, int] | None = None  # rows the buffer holds now
        self._kernel: int | None = None
        self._generators: list[torch.Generator] = []  # the seeded rows', in order
        self._seeded_at: torch.Tensor | None = None  # their indices in the batch

    @property
    def pool(self) -> TokenCountPool:
        return self.graphs.runner.input_batch.penalty_counts

    def continues(self, rows: np.ndarray, epochs: np.ndarray) -> bool:
        """Whether the runner's step now (of these InputBatch rows; epochs: InputBatch.epoch)
        follows its step before, a graph draw of the same penalised rows: their counts hold
        every token, none is to be taken from the device (the runner's pending tokens)."""
        pen = self.penalties
        if self._key is None or not pen.active:
            return False
        if not self.pool.continues(pen.rows, self.graphs.runner.steps):
            return False
        return self._key[:2] == (rows.tobytes(), epochs[rows].tobytes())

    def draw(
        self, logits: torch.Tensor, rows: list[SamplingRow], key: tuple[np.ndarray, np.ndarray]
    ) -> torch.Tensor | None:
        """logits: the decode graph's [batch, vocab] rows; key: the rows' InputBatch rows and
        their epochs (the same arrays mean the same requests in the same order)."""
        batch, vocab = logits.shape
        bucket = self.graphs.bucket_for(batch)
        ident = (key[0].tobytes(), key[1].tobytes(), bucket)
        if ident != self._key:  # the rows changed: pick the kernel, send their parameters
            self._kernel = graph_kernel(rows, vocab)
            self._key = ident
            if self._kernel is not None:
                self._send(rows, bucket)
            else:
                self.penalties.send([], bucket)
        if self._kernel is None:
            return None
        pen, pool, step = self.penalties, self.pool, self.graphs.runner.steps
        if pen.active:
            pen.sync(pool, vocab, step)
        if self._seeded_at is not None:  # a seeded row's uniform from its own generator
            own = [torch.rand(1, generator=g, device=self.device) for g in self._generators]
            self.params[_U_SEEDED].index_copy_(0, self._seeded_at, torch.cat(own))
        self.replays += 1
        tokens = self._run(logits, bucket, self._kernel, pool if pen.active else None)[:batch]
        if pen.active:
            pen.drew(pool, step)
        return tokens

    def _send(self, rows: list[SamplingRow], bucket: int) -> None:
        host = np.empty((len(_PADDING), bucket), dtype=np.float32)
        host[:] = np.asarray(_PADDING, dtype=np.float32)[:, None]
        n = len(rows)
        host[_TEMP, :n] = [r.params.temperature for r in rows]
        host[_TOP_K, :n] = [r.params.top_k for r in rows]  # exact in float32 (<= vocab)
        host[_TOP_P, :n] = [r.params.top_p for r in rows]
        host[_MIN_P, :n] = [r.params.min_p for r in rows]
        seeded = [k for k, r in enumerate(rows) if r.generator is not None]
        self._generators = [rows[k].generator for k in seeded]
        self._seeded_at = to_device(np.asarray(seeded), self.device) if seeded else None
        host[_SEEDED, seeded] = 1.0
        self.params[:, :bucket].copy_(to_device(host, self.device))
        self.penalties.send(rows, bucket)

    def _body(self, logits: torch.Tensor, bucket: int, kernel: int, pool) -> torch.Tensor:
        """pool: the penalty counts when some row has a penalty, else None."""
        from hf_paged.kernels.sampling import sample_rows
        from hf_paged.kernels.sampling_topk import sample_rows_topk

        p = self.params[:, :bucket]
        u = torch.rand(bucket, device=self.device)  # unseeded rows: torch's default generator
        u = torch.where(p[_SEEDED] > 0, p[_U_SEEDED], u)
        x = logits[:bucket]
        if pool is not None:
            x = self.penalties.apply(x, pool, bucket)
        args = (x, p[_TEMP], p[_TOP_K].to(torch.int32), p[_TOP_P], p[_MIN_P], u)
        tokens = sample_rows_topk(*args, kernel) if kernel else sample_rows(*args)
        if pool is not None:
            self.penalties.count(tokens, pool, bucket)
        return tokens

    def _run(self, logits: torch.Tensor, bucket: int, kernel: int, pool) -> torch.Tensor:
        graphs = self.graphs
        if graphs.eager:  # the decode graph's logits are this step's tensor: run as it is
            full = torch.empty((bucket, logits.shape[1]), dtype=logits.dtype, device=logits.device)
            full[: logits.shape[0]] = logits
            full[logits.shape[0] :] = 0.0
            return self._body(full, bucket, kernel, pool)
        counts = GraphPenalties.tensors_key(pool) if pool is not None else None
        entry = self.captured.get((bucket, kernel, counts))
        if entry is not None:
            graph, out = entry
            graph.replay()
            return out
        # first use: draw this step eagerly (compiles the kernel variant), then capture
        # (a graph of the pool's old tensors, before it grew, is dropped)
        if counts is not None:
            for old in [k for k in self.captured if k[:2] == (bucket, kernel) and k[2]]:
                del self.captured[old]
        static = graphs.outputs[("decode", bucket)]
        tokens = self._body(static, bucket, kernel, pool)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._body(static, bucket, kernel, pool)
        self.captured[(bucket, kernel, counts)] = (graph, out)
        return tokens
