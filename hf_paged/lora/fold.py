"""The LoRA shrink inside the base GEMM: a projection whose slots' A rows are appended to its
weight computes x @ [W; A_0; ...; A_S-1]^T in one matmul, so each token's x @ A^T for every slot
comes out beside the base product, and one expand reads its own slot's columns from there.

Why: a separate shrink is one more launch per projection. In a decode step it costs ~6 us of
latency for a few KB of work (4 a decoder layer); in a prefill chunk it re-reads x. Appended
rows cost their bytes in the GEMM instead: slots * rank rows next to the projection's
thousands (W1 on the TinyLlama-1.1B shape, 8 slots of rank 16: +5% of a layer's weight bytes,
against four launches; evals/RESULTS.md).

Layout: `ext` [out + S * slices * R, in] holds the weight's rows, then A's (slot-major, as the
slot buffers [S, slices * R, in]); the weight and the slot buffer A are views of it, so loading an
adapter into a slot writes the GEMM's rows, and the base weights keep their values (their
storage moves once, at start-up; shutdown moves them back). With a bias, `ext_bias` is the bias
and zeros.

Only plain floating-point weights fold (not bitsandbytes' or FP8), and only while the appended
rows stay under MAX_EXTRA_ROWS of the projection's own: in a prefill chunk the GEMM is
compute-bound and every row costs its share. The others keep the separate shrink
(hf_paged/lora/layers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_paged.worker.forward_context import get_forward_context

EXT_WEIGHT, EXT_BIAS = "hf_paged_lora_ext_weight", "hf_paged_lora_ext_bias"
MAX_EXTRA_ROWS = 0.25  # appended A rows, as a share of the projection's output rows
# The LoRA ops' Triton kernels run on CUDA tensors; None: there only (torch refs elsewhere).
# Tests set True to run them in Triton's CPU interpreter inside an engine step.
USE_KERNELS: bool | None = None


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda if USE_KERNELS is None else USE_KERNELS


def foldable(weight: torch.Tensor, extra_rows: int) -> bool:
    """A weight of extra_rows more rows would pay (16- or 32-bit floats only: not FP8's
    float8 weights, whose GEMM takes per-block scales, nor bitsandbytes' packed ones)."""
    floats = (torch.float32, torch.float16, torch.bfloat16)
    return weight.dtype in floats and extra_rows <= MAX_EXTRA_ROWS * weight.shape[0]


@torch.no_grad()
def extend(owner: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """Move owner's weight (and bias) into ext with a's rows appended (a: [S, rows, in], its
    contents kept); register ext on owner; return the view of ext that replaces a."""
    weight = owner.weight
    out, k = weight.shape
    ext = torch.empty(out + a.shape[0] * a.shape[1], k, dtype=weight.dtype, device=weight.device)
    ext[:out].copy_(weight)
    ext[out:].copy_(a.reshape(-1, k))
    owner.weight = nn.Parameter(ext[:out], requires_grad=weight.requires_grad)
    owner.register_buffer(EXT_WEIGHT, ext, persistent=False)
    if owner.bias is not None:
        bias = torch.zeros(ext.shape[0], dtype=owner.bias.dtype, device=owner.bias.device)
        bias[:out].copy_(owner.bias)
        owner.register_buffer(EXT_BIAS, bias, persistent=False)
    return ext[out:].view(a.shape)


@torch.no_grad()
def restore(owner: nn.Module) -> None:
    """Give owner's weight storage of its own again (the appended rows are freed with ext)."""
    if owner._buffers.pop(EXT_WEIGHT, None) is None:
        return
    owner._buffers.pop(EXT_BIAS, None)
    weight = owner.weight
    owner.weight = nn.Parameter(weight.clone(), requires_grad=weight.requires_grad)


def folded(owner: nn.Module) -> bool:
    return EXT_WEIGHT in owner._buffers


def product(owner: nn.Module, x: torch.Tensor, b, scale, sizes: list[int]) -> torch.Tensor:
    """owner's base product of x plus each token's LoRA delta (an engine step's), through the
    extended GEMM: [..., sum(sizes)], a view of a wider product."""
    full = F.linear(x, owner._buffers[EXT_WEIGHT], owner._buffers.get(EXT_BIAS))
    fold_add_(full, b, scale, sizes)
    return full[..., : sum(sizes)]


@torch.library.custom_op("hf_paged::lora_fold_add_", mutates_args=("full",))
def fold_add_(full: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, sizes: list[int]) -> None:
    """full [..., sum(sizes) + S * len(sizes) * R] (the extended GEMM's product): its first
    sum(sizes) columns += each token's own slot's columns of the rest @ B[slot]^T * scale."""
    ctx = get_forward_context()
    batch = ctx.lora_groups if ctx is not None else None
    if batch is None:  # no token of the step has an adapter
        return
    flat = full.view(-1, full.shape[-1])  # F.linear's fresh output: contiguous
    n = sum(sizes)
    y, s_all = flat[:, :n], flat[:, n:]
    if use_kernels(full):
        from hf_paged.kernels.lora import lora_expand_folded

        # check=False: every argument is the engine's own (the extended product's columns, the
        # slot buffers, scale [slices, S], the step's segments); this runs for each projection
        # of every eager prefill step, whose host time the GPU waits for
        segments = (batch.sorted_tokens, batch.slot_start)
        lora_expand_folded(y, s_all, b, scale, *segments, sizes, check=False)
    else:
        from hf_paged.kernels.lora import lora_expand_ref, own_slot_columns

        own = own_slot_columns(s_all, batch.token_slots, len(sizes) * b.shape[-1])
        y.copy_(lora_expand_ref(y, own, b, scale, batch.token_slots, slices=sizes))


@fold_add_.register_fake
def _(full, b, scale, sizes) -> None:
    return None
