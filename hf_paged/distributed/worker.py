"""A worker process: one rank other than 0. It joins the process group, builds its shard of the
model (a meta-device skeleton of rank 0's model class, sharded, filled with the tensors rank 0
sends), runs the same start-up as rank 0's engine (attention routing, fused projections, the
runner's KV-cache probe and sizing, the start-up check) and then mirrors rank 0's forwards until
told to stop. Any failure is reported on its pipe and ends the process: rank 0's next collective
or liveness check turns it into an error there.

The start-up must run the same collectives in the same order as rank 0's Engine: every forward
of the sharded model is one (hf_paged/engine/engine.py builds the same parts in the same order).
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_paged.config import EngineConfig
from hf_paged.distributed import collectives
from hf_paged.distributed.sharding import set_tensor, shard_model
from hf_paged.distributed.step_inputs import receive_forward


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    rank: int
    world: int
    init_method: str
    device_type: str
    model_class: type
    model_config: object  # the model's transformers config, its attention as before the engine
    config: EngineConfig


class Follower:
    """The runner's tensor-parallel handle on a worker: it joins rank 0's start-up collectives;
    steps arrive through the worker loop, not through the runner."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def min_over_ranks(self, value: int) -> int:
        return collectives.min_over_ranks(value, self.device)

    def on_block_copies(self, copies) -> None:
        pass  # received from rank 0 by the worker loop already


class _Owner:
    """The engine-like owner of the worker's attention routing lease."""


def run_worker(args: WorkerArgs, conn) -> None:
    code = 0
    try:
        device = torch.device("cpu")
        if args.device_type == "cuda":
            device = torch.device("cuda", args.rank)
            torch.cuda.set_device(device)
        collectives.init_group(args.init_method, args.rank, args.world, device)
        model = _receive_model(args, conn, device)
        runner = _start(model, args.config, device)
        _serve(conn, runner, device)
    except BaseException as exc:  # reported to rank 0, then the process ends
        code = 1
        line = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        try:
            conn.send(("error", line))
        except OSError:
            pass
        traceback.print_exc(file=sys.stderr)
    finally:
        try:
            collectives.destroy_group()
        finally:
            conn.close()
            sys.stderr.flush()
            os._exit(code)  # no atexit handlers of the parent's modules; nothing to flush


def _receive_model(args: WorkerArgs, conn, device: torch.device) -> torch.nn.Module:
    with torch.device("meta"):
        model = args.model_class(args.model_config)
    sharded = shard_model(model, args.rank, args.world)
    specs = conn.recv()
    entries = sharded.tensors()
    names = [name for _, _, name in entries]
    if names != [name for name, _, _ in specs]:
        raise RuntimeError(f"rank {args.rank}: the model skeleton's tensors differ from rank 0's")
    for (module, attr, _), (_, shape, dtype) in zip(entries, specs):
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=0)
        set_tensor(module, attr, t)
    return model.eval()


def _start(model: torch.nn.Module, config: EngineConfig, device: torch.device):
    """Rank 0's Engine start-up, the parts that run the model (engine.py, EngineCore)."""
    from hf_paged.engine.verify import verify_model
    from hf_paged.integrations.fused_projections import fuse_projections
    from hf_paged.integrations.transformers import enable_paged_attention
    from hf_paged.worker.model_runner import ModelRunner

    owner = _Owner()
    lease = enable_paged_attention(model, owner)
    if config.fuse_projections:
        fuse_projections(model)
    runner = ModelRunner(model, config, tp=Follower(device))
    runner.owner = owner  # the lease's owners are weak references: keep it alive
    if config.verify_model:
        verify_model(model, runner, lease)
    return runner


@torch.inference_mode()
def _serve(conn, runner, device: torch.device) -> None:
    from hf_paged.worker.forward_context import ForwardContext, forward_context

    while True:
        try:
            msg = conn.recv()
        except EOFError:  # rank 0 is gone
            raise RuntimeError("rank 0 closed the connection") from None
        kind = msg[0]
        if kind == "forward":
            ids, positions, keep, meta = receive_forward(msg[1], device)
            ctx = ForwardContext(meta, runner.kv_caches, runner.backend, kv_scales=runner.kv_scales)
            with forward_context(ctx):
                runner.forward(ids, positions, keep)
        elif kind == "copy":
            runner.copy_blocks(msg[1])
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown message {kind!r}")
