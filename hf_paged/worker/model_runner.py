"""Runs one scheduled step: flat token batch -> model forward over the paged cache -> tokens.

No padding: the step's tokens from every scheduled request are concatenated into one row of
input_ids/position_ids, and attention metadata tells each layer where each sequence starts and
which cache blocks it owns. Logits are computed only where a token is sampled (and, for requests
that asked for prompt log-probs, at every prompt position).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.config import EngineConfig
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.request import Request
from hf_paged.core.scheduler import ModelRunnerOutput, SchedulerOutput
from hf_paged.sample.sampler import Sampler
from hf_paged.worker.async_output import PendingOutput
from hf_paged.worker.attention import make_backend
from hf_paged.worker.forward_context import (
    AttentionMetadata,
    ForwardContext,
    PendingTokens,
    forward_context,
)
from hf_paged.worker.host_to_device import to_device
from hf_paged.worker.input_batch import InputBatch
from hf_paged.worker.model_forward import ModelForward
from hf_paged.worker.startup import KVCacheSpec, determine_num_blocks, warm_up_kernels


@dataclass(slots=True)
class StepInputs:
    """One step's flat batch on the host (numpy), before it is copied to the device."""

    rows: np.ndarray  # int64 [num_seqs], InputBatch rows
    starts: np.ndarray  # int64 [num_seqs], num_computed_tokens before the step
    num_sched: np.ndarray  # int64 [num_seqs]
    seq_lens: np.ndarray  # int64 [num_seqs]
    qsl: np.ndarray  # int64 [num_seqs + 1]
    total_tokens: np.ndarray  # int64 [num_seqs], request.num_tokens
    positions: np.ndarray  # int64 [num_tokens]
    input_ids: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    # asynchronous scheduling: tokens sampled by the previous step, not on the host yet (their
    # input id is read on the device from ModelRunner.last_tokens); None when there are none
    pending: np.ndarray | None  # bool [num_tokens]
    row_of_token: np.ndarray  # int64 [num_tokens]
    max_blocks: int
    decode_only: bool
    any_logprobs: bool
    features: int  # every SamplingParams.features bit of the step's requests (0: plain greedy)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        param = next(model.parameters())
        self.device = param.device
        model_dtype = getattr(model, "dtype", param.dtype)
        if config.kv_cache_dtype == "auto":
            kv_dtype = model_dtype
        else:
            kv_dtype = getattr(torch, config.kv_cache_dtype, None)
            if not isinstance(kv_dtype, torch.dtype) or not kv_dtype.is_floating_point:
                raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype!r} is not a float dtype")
        self.block_size = config.block_size
        self.spec = KVCacheSpec(model, config.block_size, kv_dtype)
        self.backend = make_backend(config.attention_backend, self.device, config.block_size)
        self._host_lists = self.backend.name == "torch"
        self.sampler = Sampler(self.device)
        self.forward = ModelForward(model, config, self.backend.name)
        try:
            self._start(config)
        except Exception:  # e.g. no memory left for the KV cache: the model goes back as it came
            self.forward.close()
            raise

    def _start(self, config: EngineConfig) -> None:
        """KV cache sizing and allocation, kernel warm-up, CUDA-graph capture."""
        self.num_blocks = determine_num_blocks(
            config, self.spec, self.device, self.forward, self.backend
        )
        self.kv_caches = self.spec.allocate(self.num_blocks, self.device)
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, config.block_size)
        # Asynchronous scheduling: each row's last sampled token stays on the device for the next
        # step, and lands on the host in one of two alternating (pinned) buffers.
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        self._host_tokens = [
            torch.empty(config.max_num_seqs, dtype=torch.long, pin_memory=pin) for _ in range(2)
        ]
        self._host_flip = 0
        self.graphs = None
        self.graph_capture_seconds = 0.0
        self.warm_up_seconds = 0.0
        if self.device.type == "cuda" and self.backend.name == "triton":
            t0 = time.perf_counter()
            warm_up_kernels(self.forward, self.kv_caches, self.backend, config, self.device)
            self.warm_up_seconds = time.perf_counter() - t0
        if self.device.type == "cuda" and config.cuda_graphs and self.backend.graph_safe:
            from hf_paged.worker.cuda_graphs import CudaGraphRunner

            t0 = time.perf_counter()
            self.graphs = CudaGraphRunner(self)
            self.graphs.capture()
            self.graph_capture_seconds = time.perf_counter() - t0

    # -- one step --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self.graphs = None
        self.kv_caches = []
        self.forward.close()  # the model goes back to its owner as it came
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self, request_id: str) -> None:
        """The request left the running set (ended or preempted): drop everything held for it,
        its row and its penalty row."""
        self.input_batch.release(request_id)
        self.sampler.release(request_id)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked blocks: KV of block src -> block dst, every layer."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    def _prepare_inputs(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepInputs:
        """Gather the step's flat batch from the persistent rows: one short loop over requests
        (row lookup, progress, new block ids), everything per token vectorised."""
        ib = self.input_batch
        requests = sched.requests
        num_seqs = len(requests)
        rows = np.empty(num_seqs, dtype=np.int64)
        starts = np.empty(num_seqs, dtype=np.int64)
        total_tokens = np.empty(num_seqs, dtype=np.int64)
        known = np.empty(num_seqs, dtype=np.int64)
        any_logprobs = False
        features = 0
        any_pending = False
        for i, r in enumerate(requests):
            row = ib.row_of(r)
            rows[i] = row
            starts[i] = r.num_computed_tokens
            total_tokens[i] = r.num_tokens
            known[i] = len(r.all_token_ids)
            any_pending |= r.num_pending > 0
            ib.sync_blocks(row, kv.get_block_ids(r.request_id))
            any_logprobs |= r.sampling_params.prompt_logprobs
            features |= r.sampling_params.features
        num_sched = np.asarray(sched.num_scheduled_tokens, dtype=np.int64)
        seq_lens = starts + num_sched
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_of_token = np.repeat(np.arange(num_seqs), num_sched)
        positions = np.arange(num_tokens) - qsl[seq_of_token] + starts[seq_of_token]
        row_of_token = rows[seq_of_token]
        bs = self.block_size
        return StepInputs(
            rows=rows,
            starts=starts,
            num_sched=num_sched,
            seq_lens=seq_lens,
            qsl=qsl,
            total_tokens=total_tokens,
            positions=positions,
            input_ids=ib.token_ids[row_of_token, positions],
            slot_mapping=ib.block_table[row_of_token, positions // bs].astype(np.int64) * bs
            + positions % bs,
            pending=positions >= known[seq_of_token] if any_pending else None,
            row_of_token=row_of_token,
            max_blocks=int(ib.num_blocks[rows].max()),
            decode_only=num_tokens == num_seqs,
            any_logprobs=any_logprobs,
            features=features,
        )

    def _metadata(self, step: StepInputs) -> AttentionMetadata:
        dev = self.device
        # numpy fancy indexing: ~20 us here, where indexing the torch tensor took ~8 ms on CPU
        table = self.input_batch.block_table[step.rows, : step.max_blocks]
        return AttentionMetadata(
            query_start_loc=to_device(step.qsl.astype(np.int32), dev),
            seq_lens=to_device(step.seq_lens.astype(np.int32), dev),
            block_table=to_device(table, dev),
            slot_mapping=to_device(step.slot_mapping, dev),
            max_query_len=int(step.num_sched.max()),
            max_seq_len=int(step.seq_lens.max()),
            # host copies for the torch backend, which loops over them (the kernels read the
            # device tensors); min_query_len lets the Triton wrapper skip its decode launch when
            # a batch has no short queries
            query_start_loc_host=step.qsl.tolist() if self._host_lists else None,
            seq_lens_host=step.seq_lens.tolist() if self._host_lists else None,
            min_query_len=int(step.num_sched.min()),
        )

    def _device_input_ids(self, step: StepInputs) -> torch.Tensor | PendingTokens:
        dev = self.device
        if step.pending is None:
            return to_device(step.input_ids, dev)
        # tokens the previous step sampled are only on the device: read them from last_tokens
        rows = to_device(step.row_of_token, dev)
        if step.pending.all():  # the usual decode step: every input is the last sampled token
            return self.last_tokens[rows]
        # some of each: the forward resolves them (in the small-batch forward's embedding kernel)
        pending = to_device(step.pending, dev)
        return PendingTokens(to_device(step.input_ids, dev), pending, rows, self.last_tokens)

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, kv: KVCacheManager, async_output: bool = False
    ) -> ModelRunnerOutput | PendingOutput:
        """Run the step. async_output: return as soon as the GPU work is queued, with a
        PendingOutput whose result() waits for the sampled tokens (one device-to-host copy)."""
        requests = sched.requests
        num_seqs = len(requests)
        step = self._prepare_inputs(sched, kv)
        starts, seq_lens, qsl = step.starts, step.seq_lens, step.qsl
        num_tokens = int(qsl[-1])

        # Which rows of logits to compute: the last token of requests that reach the end of their
        # known tokens (they sample), plus every prompt position of prompt-logprob requests.
        logprob_spans: list[
            tuple[Request, int, int, int]
        ] = []  # (req, first pos, count, keep offset)
        if not step.any_logprobs:  # the kept rows are exactly the sampling rows, in order
            sample_idx = np.flatnonzero(seq_lens == step.total_tokens)
            sample_rows = sample_idx.tolist()
            keep = qsl[sample_idx + 1] - 1
        else:
            sample_rows, sample_keep, kept = [], [], []
            for i, r in enumerate(requests):
                start, end = int(starts[i]), int(seq_lens[i])
                if r.sampling_params.prompt_logprobs and start < r.num_prompt_tokens - 1:
                    last = min(end, r.num_prompt_tokens - 1)  # start..last-1 predict prompt tokens
                    logprob_spans.append((r, start, last - start, len(kept)))
                    kept.extend(range(int(qsl[i]), int(qsl[i]) + last - start))
                if end == r.num_tokens:
                    sample_rows.append(i)
                    sample_keep.append(len(kept))
                    kept.append(int(qsl[i + 1]) - 1)
            sample_idx = np.asarray(sample_rows, dtype=np.int64)
            keep = np.asarray(kept, dtype=np.int64)
        if not keep.size:  # the forward still writes K/V; its logits are unused
            keep = np.array([num_tokens - 1], dtype=np.int64)

        dev = self.device
        graphs = self.graphs
        rows_t = None  # the sampled rows on the device, where a graph's inputs already hold them
        graph_tokens = None  # a decode graph's in-graph greedy tokens, already in last_tokens
        if (
            graphs is not None
            and step.decode_only
            and len(sample_rows) == num_seqs
            and num_seqs <= graphs.max_batch_size
        ):
            logits = graphs.run(step)  # every row samples: logits for all, in order
            rows_t = graphs.decode_rows(num_seqs)
            graph_tokens = graphs.greedy_tokens(num_seqs)
        elif (
            graphs is not None
            and not logprob_spans  # prompt log-probs keep more rows than a graph holds
            and graphs.token_bucket_for(num_tokens) is not None
        ):
            logits = graphs.run_mixed(step, keep)
        else:
            meta = self._metadata(step)
            ids_t = self._device_input_ids(step)
            pos_t = to_device(step.positions, dev)
            keep_t = to_device(keep, dev)
            with forward_context(ForwardContext(meta, self.kv_caches, self.backend)):
                logits = self.forward(ids_t, pos_t, keep_t)

        for r, first, count, offset in logprob_spans:
            rows = logits[offset : offset + count].float().log_softmax(-1)
            targets = torch.tensor(r.prompt_token_ids[first + 1 : first + 1 + count], device=dev)
            values = rows.gather(-1, targets[:, None])[:, 0].tolist()
            if r.prompt_logprobs is None:
                r.prompt_logprobs = [None] * r.num_prompt_tokens
            r.prompt_logprobs[first + 1 : first + 1 + count] = values

        tokens_t = None
        landed = None  # the step's tokens as they arrive in pinned host memory, no copy needed
        idx = sample_idx
        if graph_tokens is not None and not step.features:
            # Every request plain greedy (no feature bits: the sampler's hot path, argmax of the
            # raw logits). The decode graph already took argmax(logits) and wrote it into
            # last_tokens and into pinned host memory: no sampler launch, no index_copy_, no
            # device-to-host copy (at batch 1 on the H200 ~17 us of kernels, copies and gaps
            # after the graph).
            tokens_t = graph_tokens
            landed = graphs.greedy_host(num_seqs)
        elif sample_rows:
            if logprob_spans:
                rows_logits = logits[torch.tensor(sample_keep, device=dev)]
            else:  # sampling rows are all of `keep`, in order
                rows_logits = logits
            # Anything else (temperature, processors, logprobs, beams, forks) samples here; after
            # a decode graph this index_copy_ overwrites its greedy tokens in last_tokens.
            tokens_t = self.sampler(rows_logits, [requests[i] for i in sample_rows])
            if self.config.async_scheduling:  # the next step may read them before the host does
                if rows_t is None:
                    rows_t = to_device(step.rows[idx], dev)
                self.last_tokens.index_copy_(0, rows_t, tokens_t)
        if async_output:
            return PendingOutput(
                self, num_seqs, sample_rows, step.rows[idx], seq_lens[idx], tokens_t, landed
            )
        if landed is not None:
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
            tokens = landed.tolist()
        else:
            tokens = tokens_t.tolist() if tokens_t is not None else []
        if tokens:
            # the sampled token is the next input of its request: write it into the request's row
            self.input_batch.token_ids[step.rows[idx], seq_lens[idx]] = tokens
        sampler = self.sampler
        return ModelRunnerOutput.from_rows(
            num_seqs, sample_rows, tokens, sampler.take_fork_tokens(), sampler.take_failures()
        )

    def _host_buffer(self, n: int) -> torch.Tensor:
        """Pinned landing buffers for sampled tokens, alternating: step n+1's copy must not
        overwrite step n's tokens before the host has read them."""
        self._host_flip ^= 1
        return self._host_tokens[self._host_flip][:n]
