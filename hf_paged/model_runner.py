"""Runs one scheduled step: flat token batch -> model forward over the paged cache -> tokens.

No padding: the step's tokens from every scheduled request are concatenated into one row of
input_ids/position_ids, and attention metadata tells each layer where each sequence starts and
which cache blocks it owns. Logits are computed only where a token is sampled (and, for requests
that asked for prompt log-probs, at every prompt position).
"""

from __future__ import annotations

import inspect
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.attention import make_backend
from hf_paged.compilation import compile_model
from hf_paged.config import EngineConfig
from hf_paged.forward_context import AttentionMetadata, ForwardContext, forward_context
from hf_paged.input_batch import InputBatch
from hf_paged.kv_cache_manager import KVCacheManager
from hf_paged.request import Request
from hf_paged.sampler import Sampler
from hf_paged.scheduler import ModelRunnerOutput, SchedulerOutput


class KVCacheSpec:
    """Per-layer KV geometry read from the model config."""

    def __init__(self, model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> None:
        cfg = model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.block_size = block_size
        self.dtype = dtype

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def allocate(
        self, num_blocks: int, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in range(self.num_layers)
        ]


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
        self.backend = make_backend(config.attention_backend, self.device)
        self.sampler = Sampler(self.device)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        use_compile = bool(config.compile)
        self._model_forward = model
        self._undo_compile = None
        self.compile_scope = config.compile_scope if use_compile else None
        if use_compile:  # hf_paged/compilation.py: whole forward or one graph for every layer
            self._model_forward, self._undo_compile = compile_model(model, config.compile_scope)
        self.compiled = use_compile
        self._compile_ok = False
        try:
            self._start(config)
        except Exception:  # e.g. no memory left for the KV cache: the model goes back as it came
            if self._undo_compile is not None:
                self._undo_compile()
            raise

    def _start(self, config: EngineConfig) -> None:
        """KV cache sizing and allocation, kernel warm-up, CUDA-graph capture."""
        self.num_blocks = self._determine_num_blocks()
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
            self._warm_up_kernels()
            self.warm_up_seconds = time.perf_counter() - t0
        if self.device.type == "cuda" and config.cuda_graphs and self.backend.graph_safe:
            from hf_paged.cuda_graphs import CudaGraphRunner

            t0 = time.perf_counter()
            self.graphs = CudaGraphRunner(self)
            self.graphs.capture()
            self.graph_capture_seconds = time.perf_counter() - t0

    # -- start-up --------------------------------------------------------------------------------

    def _determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        per_block = self.spec.bytes_per_block
        blocks_per_seq = -(-cfg.max_model_len // self.block_size)
        if self.device.type != "cuda":
            # Enough for max_num_seqs full-length sequences, within cpu_kv_cache_bytes.
            return max(
                1, min(cfg.cpu_kv_cache_bytes // per_block, cfg.max_num_seqs * blocks_per_seq)
            )
        return self._profile_cuda_num_blocks(per_block)

    @torch.inference_mode()
    def _profile_cuda_num_blocks(self, per_block: int) -> int:
        """Run one forward at the full token budget with a scratch cache, measure peak memory, and
        give the KV cache what remains of gpu_memory_utilization * total memory."""
        cfg = self.config
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = cfg.max_num_batched_tokens
        seq_len = min(num_tokens, cfg.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + (
            [num_tokens % seq_len] if num_tokens % seq_len else []
        )
        scratch_blocks = sum(-(-n // self.block_size) for n in lens)
        caches = self.spec.allocate(scratch_blocks, self.device)
        meta, positions = _profile_metadata(lens, self.block_size, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        keep = torch.arange(max(0, num_tokens - cfg.max_num_seqs), num_tokens, device=self.device)
        with torch.inference_mode(), forward_context(ForwardContext(meta, caches, self.backend)):
            logits = self._forward(ids, positions, keep)
            logits.float().softmax(-1)  # the sampler's working set
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        kv_bytes = int(total * cfg.gpu_memory_utilization) - peak - non_torch
        num_blocks = kv_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves no memory for the KV "
                f"cache (peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB); raise it or "
                "lower max_num_batched_tokens"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def _warm_up_kernels(self) -> None:
        """Run the attention-kernel variants a run can meet (mixed prefill + decode, decode with
        and without the flash-decoding split, short and long contexts) once now. Triton compiles
        a variant on first use, ~1 s each for the paged kernel on the H200: without this, the
        first mixed steps of a run pay for it. Nothing is written (slots -1); logits are unused."""
        bs = self.block_size
        long = min(self.config.max_model_len, 4096)
        shapes = (
            ([64, 1], [64, 8]),  # mixed: a prefill tile and a decode tile, short context
            ([64, 1, 1], [long, long, 9]),  # mixed, long context
            ([1], [8]),  # decode, no split
            ([1], [long]),  # decode, split KV
            ([1, 1], [long, 9]),
        )
        for q_lens, seq_lens in shapes:
            width = -(-max(seq_lens) // bs)
            table = torch.zeros((len(q_lens), width), dtype=torch.int32, device=self.device)
            meta = AttentionMetadata.from_lengths(q_lens, seq_lens, table)
            pos = torch.cat(
                [torch.arange(s - q, s, device=self.device) for q, s in zip(q_lens, seq_lens)]
            )
            ids = torch.zeros_like(pos)
            keep = torch.tensor(np.cumsum(q_lens) - 1, device=self.device)
            with forward_context(ForwardContext(meta, self.kv_caches, self.backend)):
                self._forward(ids, pos, keep)
        torch.cuda.synchronize(self.device)

    # -- one step --------------------------------------------------------------------------------

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor):
        if self.compiled and not self._compile_ok:  # the first compiled forward compiles
            try:
                out = self._forward_impl(input_ids, positions, keep)
            except torch._dynamo.exc.TorchDynamoException as exc:
                self._fall_back_to_eager(exc)
                return self._forward_impl(input_ids, positions, keep)
            self._compile_ok = True
            return out
        return self._forward_impl(input_ids, positions, keep)

    def _fall_back_to_eager(self, exc: Exception) -> None:
        """torch.compile could not compile this model: run it eagerly rather than not at all,
        and say so (compile=False skips the attempt)."""
        warnings.warn(
            f"hf_paged: torch.compile failed for {type(self.model).__name__} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); running the model "
            "without compile. Pass compile=False to skip the attempt.",
            RuntimeWarning,
            stacklevel=3,
        )
        if self._undo_compile is not None:
            self._undo_compile()
            self._undo_compile = None
        self._model_forward = self.model
        self.compiled = False
        self.compile_scope = None

    def _forward_impl(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor):
        # One calling convention for every forward (profiling, CUDA-graph capture, steps): the
        # compiled frame guards on the kwargs, so a different set would compile the model again.
        model = self._model_forward
        if self.compiled:
            # Dynamo specialises a size of 1 and would compile the whole model again for it
            # (~35 s for 22 layers): a lone token runs eager (graphs pad batch 1 to 2, so only
            # a mixed step of one 1-token prompt gets here) and one kept row is kept twice.
            if input_ids.shape[0] == 1:
                if self.compile_scope == "layers":  # the layers are compiled in place
                    with torch.compiler.set_stance("force_eager"):
                        return self._call_model(self.model, input_ids, positions, keep)
                model = self.model
            elif keep.shape[0] == 1:
                return self._call_model(self._model_forward, input_ids, positions, keep.repeat(2))[
                    :1
                ]
        return self._call_model(model, input_ids, positions, keep)

    def _call_model(self, model, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor):
        if self._logits_to_keep:
            out = model(
                input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep
            )
            return out.logits[0]
        out = model(input_ids=ids[None], position_ids=pos[None], use_cache=False)
        return out.logits[0, keep]

    def shutdown(self) -> None:
        self.graphs = None
        self.kv_caches = []
        if self._undo_compile is not None:  # the model goes back to its owner as it came
            self._undo_compile()
            self._undo_compile = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self, request_id: str) -> None:
        """The request left the running set (finished, aborted or preempted): free its row."""
        self.input_batch.release(request_id)

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
        )

    def _metadata(self, step: StepInputs) -> AttentionMetadata:
        dev = self.device
        # numpy fancy indexing: ~20 us here, where indexing the torch tensor took ~8 ms on CPU
        table = torch.from_numpy(self.input_batch.block_table[step.rows, : step.max_blocks])
        return AttentionMetadata(
            query_start_loc=torch.from_numpy(step.qsl.astype(np.int32)).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(step.seq_lens.astype(np.int32)).to(dev, non_blocking=True),
            block_table=table.to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(step.slot_mapping).to(dev, non_blocking=True),
            max_query_len=int(step.num_sched.max()),
            max_seq_len=int(step.seq_lens.max()),
            # host copies: the torch backend loops over them; the Triton wrapper uses them to skip
            # its decode launch when a batch has no short queries
            query_start_loc_host=step.qsl.tolist(),
            seq_lens_host=step.seq_lens.tolist(),
        )

    def _forward_all(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Forward with logits for every token (decode batches, where every token samples)."""
        keep = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self._forward(input_ids, positions, keep)

    def _device_input_ids(self, step: StepInputs) -> torch.Tensor:
        dev = self.device
        ids = torch.from_numpy(step.input_ids).to(dev, non_blocking=True)
        if step.pending is None:
            return ids
        # tokens the previous step sampled are only on the device: read them from last_tokens
        pending = torch.from_numpy(step.pending).to(dev, non_blocking=True)
        rows = torch.from_numpy(step.row_of_token).to(dev, non_blocking=True)
        return torch.where(pending, self.last_tokens[rows], ids)

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
        if not step.any_logprobs:
            sample_idx = np.flatnonzero(seq_lens == step.total_tokens)
            sample_rows = sample_idx.tolist()
            keep = (qsl[sample_idx + 1] - 1).tolist()
            sample_keep = list(range(len(keep)))
        else:
            sample_rows, sample_keep, keep = [], [], []
            for i, r in enumerate(requests):
                start, end = int(starts[i]), int(seq_lens[i])
                if r.sampling_params.prompt_logprobs and start < r.num_prompt_tokens - 1:
                    last = min(end, r.num_prompt_tokens - 1)  # start..last-1 predict prompt tokens
                    logprob_spans.append((r, start, last - start, len(keep)))
                    keep.extend(range(int(qsl[i]), int(qsl[i]) + last - start))
                if end == r.num_tokens:
                    sample_rows.append(i)
                    sample_keep.append(len(keep))
                    keep.append(int(qsl[i + 1]) - 1)
        if not keep:
            keep.append(num_tokens - 1)  # the forward still writes K/V; its logits are unused

        dev = self.device
        if (
            self.graphs is not None
            and step.decode_only
            and len(sample_rows) == num_seqs
            and num_seqs <= self.graphs.max_batch_size
        ):
            ids_t = self._device_input_ids(step) if step.pending is not None else None
            logits = self.graphs.run(step, ids_t)  # every row samples: logits for all, in order
        else:
            meta = self._metadata(step)
            ids_t = self._device_input_ids(step)
            pos_t = torch.from_numpy(step.positions).to(dev, non_blocking=True)
            keep_t = torch.tensor(keep, dtype=torch.long).to(dev, non_blocking=True)
            with forward_context(ForwardContext(meta, self.kv_caches, self.backend)):
                logits = self._forward(ids_t, pos_t, keep_t)

        for r, first, count, offset in logprob_spans:
            rows = logits[offset : offset + count].float().log_softmax(-1)
            targets = torch.tensor(r.prompt_token_ids[first + 1 : first + 1 + count], device=dev)
            values = rows.gather(-1, targets[:, None])[:, 0].tolist()
            if r.prompt_logprobs is None:
                r.prompt_logprobs = [None] * r.num_prompt_tokens
            r.prompt_logprobs[first + 1 : first + 1 + count] = values

        sampled = [-1] * num_seqs
        tokens_t = None
        idx = np.asarray(sample_rows, dtype=np.int64)
        if sample_rows:
            if logprob_spans:
                rows_logits = logits[torch.tensor(sample_keep, device=dev)]
            else:  # sampling rows are all of `keep`, in order
                rows_logits = logits
            tokens_t = self.sampler(rows_logits, [requests[i] for i in sample_rows])
            if self.config.async_scheduling:  # the next step may read them before the host does
                rows_t = torch.from_numpy(step.rows[idx]).to(dev, non_blocking=True)
                self.last_tokens.index_copy_(0, rows_t, tokens_t[: len(sample_rows)])
        if async_output:
            return PendingOutput(
                self, num_seqs, sample_rows, step.rows[idx], seq_lens[idx], tokens_t
            )
        if tokens_t is not None:
            tokens = tokens_t.tolist()
            for i, t in zip(sample_rows, tokens):
                sampled[i] = t
            # the sampled token is the next input of its request: write it into the request's row
            self.input_batch.token_ids[step.rows[idx], seq_lens[idx]] = tokens
        return ModelRunnerOutput(
            sampled_token_ids=sampled, fork_token_ids=self.sampler.take_fork_tokens()
        )

    def _host_buffer(self, n: int) -> torch.Tensor:
        """Pinned landing buffers for sampled tokens, alternating: step n+1's copy must not
        overwrite step n's tokens before the host has read them."""
        self._host_flip ^= 1
        return self._host_tokens[self._host_flip][:n]


class PendingOutput:
    """A launched step's sampled tokens on their way to the host (asynchronous scheduling)."""

    def __init__(self, runner: ModelRunner, num_seqs, sample_rows, rows, positions, tokens_t):
        self.runner = runner
        self.num_seqs = num_seqs
        self.sample_rows = sample_rows  # indices into the step's requests
        self.rows = rows  # their InputBatch rows, and the epochs of those rows now
        self.epochs = runner.input_batch.epoch[rows]
        self.positions = positions  # where each sampled token goes in its row
        self.event = None
        self.host = None
        if tokens_t is not None:
            self.host = runner._host_buffer(len(sample_rows))
            self.host.copy_(tokens_t, non_blocking=True)
            if runner.device.type == "cuda":
                self.event = torch.cuda.Event()
                self.event.record()

    def result(self) -> ModelRunnerOutput:
        sampled = [-1] * self.num_seqs
        if self.host is None:
            return ModelRunnerOutput(sampled_token_ids=sampled)
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host.numpy().copy()
        for i, t in zip(self.sample_rows, tokens.tolist()):
            sampled[i] = t
        # still running (row not released or reused): the token is its row's next input
        ib = self.runner.input_batch
        live = ib.epoch[self.rows] == self.epochs
        ib.token_ids[self.rows[live], self.positions[live]] = tokens[live]
        return ModelRunnerOutput(sampled_token_ids=sampled)


def _profile_metadata(lens: list[int], block_size: int, device: torch.device):
    max_blocks = max(-(-n // block_size) for n in lens)
    block_table = np.zeros((len(lens), max_blocks), dtype=np.int64)
    positions, slots, next_block = [], [], 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        block_table[i, :nb] = np.arange(next_block, next_block + nb)
        next_block += nb
        pos = np.arange(n)
        positions.append(pos)
        slots.append(block_table[i, pos // block_size] * block_size + pos % block_size)
    table = torch.from_numpy(block_table.astype(np.int32)).to(device)
    meta = AttentionMetadata.from_lengths(lens, lens, table)
    meta.slot_mapping = torch.from_numpy(np.concatenate(slots)).to(device)  # write, as steps do
    return meta, torch.from_numpy(np.concatenate(positions)).to(device)
