"""The process group and the collectives inside the sharded forward (torch.distributed: gloo on
CPU, NCCL on CUDA).

One tensor-parallel group per process: the default group, set up by rank 0 (the user's process)
and by each worker process it starts. Every collective runs under the group's timeout, so a rank
that stops answering ends the others with an error instead of a hang.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective that waits longer than this raises (gloo) or ends the process (NCCL's watchdog).
# Start-up waits on the other ranks' imports and weight transfer: minutes for a 70B-class model.
TIMEOUT = timedelta(seconds=600)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(init_method: str, rank: int, world: int, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT, **kwargs
    )


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_hook(module, args, output: torch.Tensor) -> torch.Tensor:
    """After a row-wise layer: every rank's partial product summed, in place."""
    dist.all_reduce(output)
    return output


def gather_hook(module, args, output: torch.Tensor) -> torch.Tensor:
    """After a column-split lm_head: every rank's vocabulary slice, concatenated in rank order."""
    parts = [torch.empty_like(output) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, output.contiguous())
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast(tensor: torch.Tensor) -> torch.Tensor:
    dist.broadcast(tensor, src=0)
    return tensor
