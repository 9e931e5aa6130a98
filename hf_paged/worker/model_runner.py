"""Runs one scheduled step: the batch's inputs -> the model forward over the paged cache -> tokens.

The runner holds what persists between steps on its side (the InputBatch rows with their
sampling state, the KV cache, last_tokens for asynchronous scheduling) and dispatches each step to
a CUDA graph (pure decodes; mixed steps within a token bucket) or to ModelForward (eager or
compiled). Logits are computed only where a token is sampled (and, for requests that asked for
prompt log-probs, at every prompt position); the sampler turns them into tokens. What crosses
its boundary is plain data: a ScheduledBatch in, a ModelRunnerOutput out.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from hf_paged.config import EngineConfig
from hf_paged.core.outputs import ModelRunnerOutput, ScheduledBatch
from hf_paged.quantization.kv_cache import kv_cache_scales, kv_cache_torch_dtype
from hf_paged.sample.sampler import Sampler
from hf_paged.sampling_params import F_PRESENCE, F_REPETITION, F_STRUCTURED
from hf_paged.worker.async_output import PendingOutput
from hf_paged.worker.attention import make_backend
from hf_paged.worker.deferred_sampling import defer_sampling, forks, sample_now
from hf_paged.worker.forward_context import ForwardContext, forward_context
from hf_paged.worker.host_to_device import to_device
from hf_paged.worker.input_batch import InputBatch
from hf_paged.worker.model_forward import ModelForward
from hf_paged.worker.startup import KVCacheSpec, capture_graphs, determine_num_blocks
from hf_paged.worker.startup_times import StartupTimes
from hf_paged.worker.step_inputs import (
    KeptRows,
    StepInputs,
    attention_metadata,
    device_input_ids,
    kept_rows,
    lora_groups,
    prepare_inputs,
)
from hf_paged.worker.verify_step import verify_step


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        lora: bool = False,
        reserved_bytes_per_block: int = 0,
        tp=None,
        startup: StartupTimes | None = None,
    ) -> None:
        self.model = model
        self.startup = startup if startup is not None else StartupTimes()  # seconds per phase
        # tensor parallelism (hf_paged/distributed): rank 0's executor, which mirrors each
        # forward to the other ranks, or a worker's handle; None on one device
        self.tp = tp
        # KV bytes per block that another cache on the same block ids takes (a draft model's)
        self.reserved_bytes_per_block = reserved_bytes_per_block
        self.config = config
        self.lora = lora  # the model has LoRA layers: steps carry each adapter's tokens
        param = next(model.parameters())
        self.device = param.device
        model_dtype = getattr(model, "dtype", param.dtype)
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, model_dtype)
        self.block_size = config.block_size
        with self.startup.phase("kv_sizing"):
            self.kv_spec = KVCacheSpec(model, config.block_size, kv_dtype)
            # FP8 caches: (k_scale, v_scale) per layer or per KV head, fixed from here on (CUDA
            # graphs bake them)
            num_kv_heads = [s.num_kv_heads for s in self.kv_spec.layers]
            self.kv_scales = kv_cache_scales(model, num_kv_heads, kv_dtype, config.kv_cache_scale)
        with self.startup.phase("setup"):
            self.backend = make_backend(config.attention_backend, self.device, config.block_size)
            self.sampler = Sampler(self.device)
            self.forward = ModelForward(model, config, self.backend.name)
        self._host_lists = self.backend.name == "torch"
        # speculative decoding (hf_paged/spec_decode): proposals for the next step, made after
        # each synchronous step; set by the engine when it speculates
        self.spec = None
        # asynchronous scheduling: the launched step whose tokens the host has not read yet
        self._pending: PendingOutput | None = None
        self.steps = 0  # steps executed (a sampling graph's penalty counts follow runs of them)
        self.startup.forward = self.forward  # its first compiled forward counts as compile
        try:
            self._start(config)
        except Exception:  # e.g. no memory left for the KV cache: the model goes back as it came
            self.forward.close()
            raise

    def _start(self, config: EngineConfig) -> None:
        """KV cache sizing and allocation, then kernel warm-up and CUDA-graph capture."""
        with self.startup.phase("kv_sizing"):
            self.num_blocks = determine_num_blocks(
                config,
                self.kv_spec,
                self.device,
                self.forward,
                self.backend,
                self.reserved_bytes_per_block,
            )
            if self.tp is not None:  # every rank's cache holds the same block ids
                self.num_blocks = self.tp.min_over_ranks(self.num_blocks)
        with self.startup.phase("kv_allocation"):
            self.kv_caches = self.kv_spec.allocate(self.num_blocks, self.device)
            self.input_batch = InputBatch(
                config.max_num_seqs, config.max_model_len, config.block_size, self.device
            )
            # Asynchronous scheduling: each row's last sampled token stays on the device for the
            # next step, and lands on the host in one of two alternating (pinned) buffers. With
            # a draft model, k entries a row more for its proposals (DeviceProposals).
            self.last_tokens = torch.zeros(
                config.max_num_seqs * (1 + _draft_k(config)), dtype=torch.long, device=self.device
            )
            pin = self.device.type == "cuda"
            self._host_tokens = [
                torch.empty(config.max_num_seqs, dtype=torch.long, pin_memory=pin) for _ in range(2)
            ]
        self._host_flip = 0
        self._run_host = None  # pinned landing rows of queue_decode_run, grown on demand
        self.graphs = None  # the warm-up forwards run before any graph exists
        self.graphs = capture_graphs(self, config, self.startup)

    def shutdown(self) -> None:
        if self._pending is not None:  # nothing may wait on a sampling never queued
            self._pending.launch()
        self.sampler.grammar.close()
        if self.spec is not None:
            self.spec.shutdown()
            self.spec = None
        self.graphs = None
        self.kv_caches = []
        self.forward.close()  # the model goes back to its owner as it came
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self, req_ids: list[str]) -> None:
        """These requests left the running set (ended, preempted or rewritten): drop their rows
        and sampling state."""
        for req_id in req_ids:
            self.input_batch.release(req_id)
        if self.spec is not None:
            self.spec.release(req_ids)

    # -- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, async_output: bool = False
    ) -> ModelRunnerOutput | PendingOutput:
        """Run the step. async_output: return as soon as the GPU work is queued, with a
        PendingOutput whose result() waits for the sampled tokens (one device-to-host copy)."""
        deferred = self._pending if self._pending and self._pending.deferred else None
        self.steps += 1
        on_device = self.spec.before_step(batch) if self.spec is not None else None
        self._update_rows(batch)
        step = prepare_inputs(batch, self.input_batch, self.block_size, on_device)
        kept = kept_rows(step, self.input_batch)
        if deferred is not None:
            # the last step's sampling (structured output) is queued just before this step's
            # forward, after this step's host-side preparation (worker/deferred_sampling.py)
            deferred.launch()
        if async_output and step.features & (F_REPETITION | F_PRESENCE):  # never a verify step
            _take_pending_tokens(self, step, kept.sample_idx)
        logits, graph_tokens, rows_t = self._run_forward(step, kept)
        if on_device is not None:
            self.spec.land(batch.spec_token_ids)
        prompt_logprobs = self._prompt_logprobs(logits, kept, step) if kept.logprob_spans else None
        sample_idx = kept.sample_idx
        num_seqs = len(batch)
        sample_rows = sample_idx.tolist()
        if step.num_spec is not None:  # a verify step (never asynchronous: see EngineCore)
            return verify_step(self, batch, step, kept, logits, prompt_logprobs)
        tokens_t = None
        landed = None  # the step's tokens as they arrive in pinned host memory, no copy needed
        sampled = None
        if graph_tokens is not None and not step.features:
            # Every request plain greedy (no feature bits: the sampler's hot path, argmax of the
            # raw logits). The decode graph already took argmax(logits) and wrote it into
            # last_tokens and into pinned host memory: no sampler launch, no index_copy_, no
            # device-to-host copy (at batch 1 on the H200 ~17 us of kernels, copies and gaps
            # after the graph).
            tokens_t = graph_tokens
            landed = self.graphs.greedy_host(num_seqs)
        elif sample_rows:
            if kept.sample_keep is not None:
                rows_logits = logits[torch.tensor(kept.sample_keep, device=self.device)]
            else:  # sampling rows are all of `keep`, in order
                rows_logits = logits
            # Anything else (temperature, processors, logprobs, beams, forks) samples here; after
            # a decode graph this index_copy_ overwrites its greedy tokens in last_tokens.
            ib = self.input_batch
            row_ids = step.rows[sample_idx]
            rows = [ib.sampling[r] for r in row_ids.tolist()]
            if step.features & F_STRUCTURED and async_output and not forks(rows, step.features):
                self._pending = defer_sampling(
                    self, step, rows_logits, rows, rows_t, sample_idx, self._pending
                )
                return self._pending
            if graph_tokens is not None:  # rows the kernels take whole: a sampling graph
                tokens_t = self.graphs.sampling.draw(logits, rows, (step.rows, ib.epoch[step.rows]))
            if tokens_t is None:
                sampled = sample_now(self, step, row_ids, rows, rows_logits)
                tokens_t = sampled.tokens
            if self.config.async_scheduling:  # the next step may read them before the host does
                if rows_t is None:  # (a decode graph's inputs hold them on the device already)
                    rows_t = to_device(row_ids, self.device)
                self.last_tokens.index_copy_(0, rows_t, tokens_t)
        if async_output:
            host = landed
            if tokens_t is not None and landed is None:
                host = self._host_buffer(len(sample_rows))
                host.copy_(tokens_t, non_blocking=True)
            self._pending = PendingOutput(
                num_seqs, sample_rows, step.rows[sample_idx], step.seq_lens[sample_idx], host,
                self.input_batch.epoch[step.rows[sample_idx]], self.device.type == "cuda",
            )  # fmt: skip
            self._pending.failed = sampled.failed if sampled is not None else None
            self._pending.device_tokens = tokens_t
            if landed is not None and self.graphs.advance:
                self._pending.decode_step = step
            return self._pending
        if landed is not None:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            tokens = landed.tolist()
        else:
            tokens = tokens_t.tolist() if tokens_t is not None else []
        if tokens:
            self.input_batch.add_tokens(step.rows[sample_idx], step.seq_lens[sample_idx], tokens)
        extra = sampled.runner_output_fields() if sampled is not None else {}
        proposals = None
        if self.spec is not None and sample_rows:
            proposals = self.spec.propose(batch, step, sample_idx, None)
        return ModelRunnerOutput.from_rows(
            num_seqs,
            sample_rows,
            tokens,
            prompt_logprobs=prompt_logprobs,
            spec_token_ids=proposals,
            **extra,
        )

    def finish_async(self, pending: PendingOutput) -> ModelRunnerOutput:
        """Wait for a launched step's tokens; each request still holding the row it sampled in
        (not released or reused meanwhile) gets its token as its row's next input."""
        pending.launch()
        if pending is self._pending:
            self._pending = None
        tokens = self._land(pending)
        if tokens is None:
            return ModelRunnerOutput.from_rows(pending.num_seqs, [], [])
        return ModelRunnerOutput.from_rows(
            pending.num_seqs, pending.sample_rows, tokens.tolist(), failed=pending.failed
        )

    def _land(self, pending: PendingOutput):
        """Wait for a launched step's tokens and write them into the rows that still belong to
        the requests that sampled them. Also called early, before the next step samples, when
        that step has grammar-constrained rows: their matchers must see the previous token
        (structured output under asynchronous scheduling; the forward is already queued, so the
        GPU keeps working while the host waits). Once per step: later calls return its tokens."""
        if pending.landed:  # its tokens are in the rows already
            return pending.tokens
        tokens = pending.wait()
        pending.landed, pending.tokens = True, tokens
        if tokens is None:
            return None
        live = self.input_batch.epoch[pending.rows] == pending.epochs
        steps = tokens if tokens.ndim == 2 else tokens[None]  # a decode run: a row a step
        for j, step_tokens in enumerate(steps):
            if live.all():
                self.input_batch.add_tokens(
                    pending.rows, pending.positions + j, step_tokens.tolist()
                )
            elif live.any():
                self.input_batch.add_tokens(
                    pending.rows[live], pending.positions[live] + j, step_tokens[live].tolist()
                )
        following = self._pending.deferred if self._pending is not None else None
        if following is not None and following.previous is pending:
            following.start_grammar()  # its matchers can take these tokens now
        return tokens

    def _update_rows(self, batch: ScheduledBatch) -> None:
        """Before the step: drop released requests, copy copied-on-write blocks, take new
        requests (in that order: a rewritten request is released and new in one batch)."""
        if batch.released_req_ids:
            self.release(batch.released_req_ids)
        if batch.block_copies:
            self.copy_blocks(batch.block_copies)
        for data in batch.new_requests:
            self.input_batch.add(data)

    def _run_forward(self, step: StepInputs, kept: KeptRows):
        """The step's logits rows: a decode graph, a mixed graph, or the forward as it is.
        Returns (logits, a decode graph's in-graph greedy tokens and its rows on the device,
        or None, None)."""
        graphs = self.graphs
        num_seqs = len(step.rows)
        if (
            graphs is not None
            and step.decode_only
            and len(kept.sample_idx) == num_seqs
            and num_seqs <= graphs.max_batch_size
        ):
            logits = graphs.run(step)  # every row samples: logits for all, in order
            return logits, graphs.greedy_tokens(num_seqs), graphs.decode_rows(num_seqs)
        num_tokens = int(step.qsl[-1])
        if (
            graphs is not None
            and not kept.logprob_spans  # prompt log-probs keep more rows than a graph holds
            and graphs.token_bucket_for(num_tokens) is not None
            # verify steps keep k + 1 rows a request: a graph holds max_num_seqs rows
            and len(kept.keep) <= graphs.max_num_seqs
        ):
            return graphs.run_mixed(step, kept.keep), None, None
        dev = self.device
        meta = attention_metadata(step, self.input_batch, dev, self._host_lists)
        ids_t = device_input_ids(step, dev, self.last_tokens)
        pos_t = to_device(step.positions, dev)
        keep_t = to_device(kept.keep, dev)
        ctx = ForwardContext(meta, self.kv_caches, self.backend, kv_scales=self.kv_scales)
        if self.lora:
            ctx.lora_groups = lora_groups(step, self.input_batch, dev)
        mirrored = (  # the other ranks run this forward on the same inputs
            self.tp.forward(ids_t, pos_t, keep_t, meta)
            if self.tp is not None
            else contextlib.nullcontext()
        )
        with mirrored, forward_context(ctx):
            return self.forward(ids_t, pos_t, keep_t), None, None

    def _prompt_logprobs(self, logits, kept: KeptRows, step: StepInputs) -> dict:
        out = {}
        ib = self.input_batch
        for i, first, count, offset in kept.logprob_spans:
            row = ib.sampling[int(step.rows[i])]
            rows = logits[offset : offset + count].float().log_softmax(-1)
            targets = torch.tensor(row.token_ids[first + 1 : first + 1 + count], device=self.device)
            out[row.req_id] = (first + 1, rows.gather(-1, targets[:, None])[:, 0].tolist())
        return out

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked blocks: KV of block src -> block dst, every layer (and on
        the other ranks, tensor parallel)."""
        if self.tp is not None:
            self.tp.on_block_copies(copies)
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for caches in self.kv_caches:
            for cache in caches:
                if cache.element_size() == 1:  # FP8: index_copy_ has no float8 kernels
                    cache = cache.view(torch.uint8)
                cache.index_copy_(0, dst, cache.index_select(0, src))

    def _host_buffer(self, n: int) -> torch.Tensor:
        """Pinned landing buffers for sampled tokens, alternating: step n+1's copy must not
        overwrite step n's tokens before the host has read them."""
        self._host_flip ^= 1
        return self._host_tokens[self._host_flip][:n]


def _draft_k(config: EngineConfig) -> int:
    """Proposals a row a draft model makes at most (0: no draft)."""
    return config.num_speculative_tokens if config.draft_model is not None else 0


def _take_pending_tokens(runner: ModelRunner, step: StepInputs, sample_idx) -> None:
    """Penalised rows whose input token (position seq_len - 1) the host has not read yet
    (asynchronous scheduling) and whose counts do not hold it (a sampling graph counts its draws
    itself): their penalty counts take it from last_tokens on the device, copied now, before the
    forward (a decode graph overwrites last_tokens with its greedy tokens)."""
    ib = runner.input_batch
    pool = ib.penalty_counts
    if runner.graphs is not None and runner.graphs.sampling.continues(step.rows, ib.epoch):
        return  # the step before drew these rows in the sampling graph and counted their tokens
    pool.settle()
    rows = step.rows[sample_idx]
    seq_lens = step.seq_lens[sample_idx]
    unknown = np.flatnonzero(ib.num_known[rows] < seq_lens)
    chosen = []
    for k in unknown.tolist():
        r = ib.sampling[int(rows[k])]
        if r.features & (F_REPETITION | F_PRESENCE) and not pool.counted_before(r, seq_lens[k]):
            r.pending_index = len(chosen)
            chosen.append(int(rows[k]))
    if chosen:
        at = to_device(np.asarray(chosen), runner.device)
        pool.pending_tokens = runner.last_tokens.index_select(0, at)


def queue_decode_run(
    runner: ModelRunner, pending: PendingOutput, n: int, out: torch.Tensor | None = None
) -> PendingOutput | None:
    """After runner.execute(..., async_output=True) returned `pending` for a plain greedy decode
    step that replayed a graph: the same rows' next n steps, each feeding the token the one
    before drew, queued with no host work between them (CudaGraphRunner.decode_again; the draft
    model's chain of proposals, where preparing each step on the host took longer than its
    forward). Returns the PendingOutput of all n + 1 steps, for finish_decode_run; `pending` is
    then read only through it (the replays reuse its landing row); out: where the tokens go on
    the device, int64 [n + 1, batch] contiguous. None where that cannot run: read `pending`
    with finish_async and run the steps as usual."""
    step = pending.decode_step
    if step is None or pending is not runner._pending or runner.tp is not None:
        return None
    tokens = runner.graphs.decode_again(step, n, out)
    if tokens is None:
        return None
    on_cuda = runner.device.type == "cuda"
    if runner._run_host is None or runner._run_host.numel() < tokens.numel():
        runner._run_host = torch.empty(tokens.numel(), dtype=torch.long, pin_memory=on_cuda)
    # a contiguous view (a strided pinned destination would make the copy synchronous), read
    # before the next run is queued
    host = runner._run_host[: tokens.numel()].view(tokens.shape)
    host.copy_(tokens, non_blocking=True)
    runner._pending = PendingOutput(
        pending.num_seqs, pending.sample_rows, pending.rows, pending.positions, host,
        pending.epochs, on_cuda,
    )  # fmt: skip
    return runner._pending


def finish_decode_run(runner: ModelRunner, run: PendingOutput) -> np.ndarray:
    """Wait for a queue_decode_run's tokens, int64 [steps, batch], and write them into the rows
    that still belong to the requests that sampled them."""
    if run is runner._pending:
        runner._pending = None
    return runner._land(run)
