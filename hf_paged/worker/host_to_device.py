"""Step inputs from host arrays to the device without making the host wait for the GPU.

A copy from pageable host memory makes the CPU wait until the work already queued on the stream
has finished, which would undo asynchronous scheduling (the host preparing step n+1 while the GPU
runs step n). Each array is first copied into pinned memory from torch's caching host allocator,
then sent with non_blocking=True; the allocator does not reuse that pinned block until the copy's
stream event has completed, so no double buffering is needed here.
"""

from __future__ import annotations

import numpy as np
import torch


def pinned(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host tensor holding `array`, pinned when `device` is CUDA (on CPU: the array itself)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staged.copy_(host)
    return staged


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return pinned(array, device).to(device, non_blocking=True)


def device_tensor(values, device: torch.device) -> torch.Tensor:
    """torch.tensor(values, device=device) through pinned memory (floats as float32, like
    torch.tensor of Python floats)."""
    array = np.asarray(values)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    return to_device(array, device)


def device_rows(rows, device: torch.device) -> list[torch.Tensor]:
    """Equal-length float lists in one host-to-device copy, each returned as its own float32 [n]
    tensor starting on a 16-byte boundary. Why: Triton specialises a kernel on each pointer
    argument's 16-byte alignment, and the rows of a plain [k, n] tensor start at multiples of
    n * 4 bytes, so a batch size not divisible by 4 compiled another variant of the sampling and
    penalty kernels in the middle of a run (on a GPU, seconds each)."""
    array = np.asarray(rows, dtype=np.float32)
    k, n = array.shape
    padded = np.zeros((k, -(-n // 4) * 4), dtype=np.float32)
    padded[:, :n] = array
    t = to_device(padded, device)
    return [t[j, :n] for j in range(k)]
