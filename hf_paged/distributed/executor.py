"""Rank 0's side of tensor parallelism: starts one worker process per other rank, shards the
model, sends each rank its shard, and mirrors every forward the runner runs to the other ranks.

The shape of vLLM V1's multi-process executor: rank 0 (the user's process) owns the Engine, the
scheduler and the sampler; each worker holds its shard and its part of the KV cache and runs the
same forward as rank 0, step by step, on the inputs rank 0 broadcasts (step_inputs.py). Only
rank 0 samples: the logits are gathered on every rank, and the tokens never leave rank 0.

Workers are started with multiprocessing's spawn and build the model from rank 0's config and
weights: a skeleton of the model's class on the meta device, sharded the same way, whose tensors
rank 0 sends over the process group itself (NCCL device to device on CUDA). No path or hub
access is needed on the workers.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import os

import torch
import torch.distributed as dist

from hf_paged.config import EngineConfig
from hf_paged.distributed import collectives
from hf_paged.distributed.sharding import check_shardable, shard_model
from hf_paged.distributed.step_inputs import send_forward
from hf_paged.distributed.worker import WorkerArgs, run_worker

# Seconds a worker gets to leave after being asked to stop, then to die after SIGTERM.
STOP_WAIT_S = 10.0


def check_tensor_parallel(model: torch.nn.Module, config: EngineConfig, lease) -> torch.device:
    """Refuse, naming the option or field, what tensor parallelism cannot run; return the
    device of rank 0 (rank r runs on the device of index r of that type)."""
    world = config.tensor_parallel_size
    device_type = config.tensor_parallel_device
    if device_type == "auto":
        device_type = next(model.parameters()).device.type
    if device_type == "cuda":
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    elif device_type == "cpu":
        available = os.cpu_count() or 1
    else:
        raise ValueError(f"tensor_parallel_device: {device_type!r} is neither 'cpu' nor 'cuda'")
    if world > available:
        raise ValueError(
            f"tensor_parallel_size={world} exceeds the {available} {device_type} devices "
            "available (one rank per device)"
        )
    for option, value, default in (
        ("draft_model", config.draft_model, None),
        ("quantization", config.quantization, None),
        ("kv_cache_dtype", config.kv_cache_dtype, "auto"),
    ):
        if value != default:
            raise ValueError(f"{option}={value!r} is not supported with tensor_parallel_size > 1")
    if lease.lora is not None:
        raise ValueError("tensor_parallel_size > 1: a PeftModel's LoRA layers are not split")
    if len(lease.owners) > 1:
        raise ValueError(
            "tensor_parallel_size > 1: another live Engine holds this model; tensor "
            "parallelism shards its weights (shut the other Engine down first)"
        )
    if dist.is_initialized():
        raise ValueError(
            "tensor_parallel_size > 1: torch.distributed is already initialised in this "
            "process; the engine sets up its own process group"
        )
    check_shardable(model, world)
    return torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")


class TensorParallelExecutor:
    """Rank 0's handle on the other ranks. The runner calls min_over_ranks at start-up, then
    forward() around each step's forward and on_block_copies for copy-on-write; close() stops the
    workers and puts the model back as it came."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, lease) -> None:
        self.device = check_tensor_parallel(model, config, lease)
        self.world = config.tensor_parallel_size
        self.failure: str | None = None
        self.procs: list = []
        self.conns: list = []
        self.sharded = None
        self._lease = lease
        init_method = f"tcp://127.0.0.1:{collectives.free_port()}"
        config_for_workers = copy.deepcopy(model.config)
        config_for_workers._attn_implementation = lease.previous
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, self.world):
                parent, child = ctx.Pipe()
                args = WorkerArgs(
                    rank, self.world, init_method, self.device.type, type(model),
                    config_for_workers, config,
                )  # fmt: skip
                proc = ctx.Process(target=run_worker, args=(args, child), daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            collectives.init_group(init_method, 0, self.world, self.device)
            self.sharded = shard_model(model, 0, self.world)
            self._send_weights()
        except BaseException:
            self.close()
            raise
        lease.references.clear()  # the start-up check's reference forward runs on every rank

    def _send_weights(self) -> None:
        sharded, device = self.sharded, self.device
        sharded.place(device)
        entries = sharded.tensors()
        specs = [(name, tuple(getattr(m, a).shape), getattr(m, a).dtype) for m, a, name in entries]
        for rank, conn in enumerate(self.conns, start=1):
            conn.send(specs)
            for module, attr, _ in entries:
                dist.send(sharded.shard_of(module, attr, rank).to(device).contiguous(), dst=rank)

    # -- what the runner calls ---------------------------------------------------------------------

    def min_over_ranks(self, value: int) -> int:
        return collectives.min_over_ranks(value, self.device)

    @contextlib.contextmanager
    def forward(self, ids, positions: torch.Tensor, keep: torch.Tensor, meta):
        """Around rank 0's forward of a step: the other ranks get its inputs and run it too. A
        failure anywhere (a rank gone, a collective timed out or refused) ends the group: the
        workers are stopped and this and every later step raise RuntimeError."""
        self._check_alive()
        try:
            if hasattr(ids, "resolve"):  # PendingTokens: the other ranks get plain ids
                ids = ids.resolve()
            header, packed = send_forward(ids, positions, keep, meta)
            for conn in self.conns:
                conn.send(("forward", header))
            collectives.broadcast(packed)
            yield
        except BaseException as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, Exception):
                raise RuntimeError(f"tensor parallel step failed: {self.failure}") from exc
            raise

    def on_block_copies(self, copies: list[tuple[int, int]]) -> None:
        self._check_alive()
        try:
            for conn in self.conns:
                conn.send(("copy", copies))
        except OSError as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            raise RuntimeError(f"tensor parallel step failed: {self.failure}") from exc

    # -- failures and shutdown ---------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.failure is None:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.exitcode is not None:
                    self._fail(f"rank {rank} exited (exit code {proc.exitcode})")
                    break
        if self.failure is not None:
            raise RuntimeError(f"tensor parallel group failed: {self.failure}")

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            # a collective fails as soon as a peer dies, possibly before the dead process is
            # reaped: a moment's wait lets the message name the rank that exited
            for proc in self.procs:
                proc.join(0.2)
            messages = self._worker_errors() + [
                f"rank {rank} exited (exit code {proc.exitcode})"
                for rank, proc in enumerate(self.procs, start=1)
                if proc.exitcode is not None and not reason.startswith(f"rank {rank} exited")
            ]
            self.failure = reason + (f"; {'; '.join(messages)}" if messages else "")
        self._stop_workers(ask=False)

    def _worker_errors(self) -> list[str]:
        """What failed workers reported before exiting (their last traceback line)."""
        out = []
        for rank, conn in enumerate(self.conns, start=1):
            with contextlib.suppress(OSError, EOFError):
                while conn.poll():
                    msg = conn.recv()
                    if isinstance(msg, tuple) and msg and msg[0] == "error":
                        out.append(f"rank {rank}: {msg[1]}")
        return out

    def _stop_workers(self, ask: bool) -> None:
        if ask:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(("stop",))
        for proc in self.procs:
            proc.join(STOP_WAIT_S if ask else 0.1)
            if proc.exitcode is None:
                proc.terminate()
                proc.join(STOP_WAIT_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join()

    def close(self) -> None:
        """Stop the workers, leave the process group, and put rank 0's model back."""
        self._stop_workers(ask=self.failure is None)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        collectives.destroy_group()
        if self.sharded is not None:
            self.sharded.restore()
            self.sharded = None
        self._lease.references.clear()
        self._lease.tp = None
