"""One step's LoRA inputs, built once per step by the runner (worker/step_inputs.py::lora_groups)
and read by every LoRA layer through the forward context."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.worker.host_to_device import to_device


@dataclass(slots=True)
class LoraBatch:
    """Which adapter slot each token of the flat batch uses. The shapes depend on the token
    count and max_loras only, never on which adapters run."""

    token_slots: torch.Tensor  # int32 [num_tokens], slot of the token's adapter; -1: none
    # for the Triton kernels: token indices grouped by slot, and where each slot's run starts
    # (kernels/lora.py::lora_segments)
    sorted_tokens: torch.Tensor  # int32 [num_tokens]
    slot_start: torch.Tensor  # int32 [max_loras + 1]


def lora_segments_host(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """kernels/lora.py::lora_segments on the host (numpy): (sorted_tokens, slot_start)."""
    key = np.where(token_slots < 0, num_slots, token_slots)
    sorted_tokens = np.argsort(key, kind="stable").astype(np.int32)
    counts = np.bincount(key, minlength=num_slots + 1)[:num_slots]
    slot_start = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(counts, out=slot_start[1:])
    return sorted_tokens, slot_start


def lora_batch(token_slots: np.ndarray, num_slots: int, device: torch.device) -> LoraBatch:
    """The batch for these per-token slots (host numpy, -1: no adapter) on the device."""
    token_slots = token_slots.astype(np.int32)
    sorted_tokens, slot_start = lora_segments_host(token_slots, num_slots)
    # one copy for the three: they are small and every LoRA layer of the step reads them. Each
    # starts on a 16-byte boundary: Triton specialises a kernel on its pointers' alignment, and
    # parts at offsets of 4 * t bytes compiled another variant of the LoRA kernels for each
    # t % 4 an eager (prefill) step met, in the middle of a run (host_to_device.device_rows)
    t = token_slots.shape[0]
    width = -(-t // 4) * 4
    packed = np.zeros(2 * width + num_slots + 1, dtype=np.int32)
    packed[:t], packed[width : width + t], packed[2 * width :] = (
        token_slots,
        sorted_tokens,
        slot_start,
    )
    packed = to_device(packed, device)
    return LoraBatch(packed[:t], packed[width : width + t], packed[2 * width :])
