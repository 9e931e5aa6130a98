"""The LoRA epilogue of the small-batch GEMVs (kernels/fused_gemv.py, kernels/qkv_rope.py): each
row's delta (s[m] @ B[slot_m]^T) * scale[slot_m] added to the product where peft adds it, from
the shrink's output (kernels/lora.py::lora_shrink) and the stacked B read inside the GEMV, so a
projection's adapters cost one shrink launch and no expand. Here: the epilogue's inputs
(LoraEpilogue), their checks and launch arguments, the device function the kernels call, and the
torch reference."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SLICES = 3  # q/k/v


@dataclass(slots=True)
class LoraEpilogue:
    """Per-row LoRA deltas for kernels/fused_gemv.py to add to its product where peft adds
    them (after the bias, before the activation and the residual): row m gets
    (s[m] @ B[slot_m]^T) * scale[slot_m], slice by slice as lora_expand computes them; rows of
    slot -1 are left bit-exact. Reading B inside the GEMV costs no expand launch, and B (R
    columns a weight row) is a small fraction of the weight rows the GEMV streams anyway."""

    s: torch.Tensor  # f32 [SPLIT_K, M, slices * R] lora_shrink's partial sums of the rows
    b: torch.Tensor  # [S, N, R] the group's B; a gated GEMV: the gate rows, then the up rows
    scale: torch.Tensor  # f32 [slices, S]
    slots: torch.Tensor  # int32 [M] each row's slot, -1: none
    slices: tuple[int, ...]  # widths over b's rows (gated: exactly (gate rows, up rows))
    # s is of x * norm_weight (lora_shrink's norm_weight): the NORM GEMV multiplies each row's
    # by its 1 / rms
    rms: bool = False


def lora_epilogue_ref(
    e: LoraEpilogue,
    y: torch.Tensor,
    columns: slice = slice(None),
    inv_rms: torch.Tensor | None = None,
):
    """y [M, n] (the product's columns `columns` of the group's, rounded) plus each row's delta,
    rounded once (what fused_gemv's epilogue computes); inv_rms [M]: each row's 1 / rms
    (e.rms)."""
    s = e.s.sum(0) if e.s.dim() == 3 else e.s
    if e.rms:
        s = s * inv_rms[:, None]
    r = e.b.shape[-1]
    delta = torch.zeros(y.shape[0], e.b.shape[1], dtype=torch.float32, device=y.device)
    start = 0
    for i, width in enumerate(e.slices):
        for m, slot in enumerate(e.slots.tolist()):
            if slot >= 0:
                h = s[m, i * r : (i + 1) * r].to(e.b.dtype).float()
                b = e.b[slot, start : start + width].float()
                delta[m, start : start + width] = (h @ b.T) * e.scale[i, slot]
        start += width
    out = (y.float() + delta[:, columns]).to(y.dtype)
    return torch.where((e.slots >= 0)[:, None], out, y)


@triton.jit
def lora_delta(s_ptr, m: tl.constexpr, SPLIT, stride_ss, stride_sm, b_ptr, stride_bs, stride_bn,
                sc_ptr, stride_sc, slot, offs_n, n_mask, E0, E1, R, row_scale,
               FIRST: tl.constexpr, SLICES: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    # row m's delta over the program's columns [BLOCK_N] (float32): B[slot]'s rows of them
    # times the shrink's R columns of each column's slice (slices FIRST.. FIRST + SLICES - 1;
    # a tile may straddle q/k/v, so each slice's product is kept where its columns are)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + offs_n.to(tl.int64)[:, None] * stride_bn
        + offs_r[None, :],
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    )  # fmt: skip
    dt = b_ptr.dtype.element_ty
    b = b.to(tl.float32)
    part = (offs_n >= E0).to(tl.int32) + (offs_n >= E1).to(tl.int32)
    delta = tl.zeros([offs_n.shape[0]], dtype=tl.float32)
    for i in tl.static_range(SLICES):
        h = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k in range(SPLIT):
            h += tl.load(
                s_ptr + k * stride_ss + m * stride_sm + (FIRST + i) * R + offs_r,
                mask=r_mask,
                other=0.0,
            )
        h = (h * row_scale).to(dt).to(tl.float32)  # peft rounds lora_A's output so
        d = tl.sum(b * h[None, :], axis=1) * tl.load(sc_ptr + (FIRST + i) * stride_sc + slot)
        if SLICES == 1:
            delta = d
        else:
            delta = tl.where(part == i, d, delta)
    return delta


def lora_launch_args(lora: LoraEpilogue | None, m: int, n: int, gated: bool, gather: bool, device):
    """The kernel's LoRA arguments (checked), or those of no LoRA."""
    if lora is None:
        return dict(pointers=None, scalars=(1, 0, 0, 0, 0, 0, 0, 0, 1), slices=0, block_r=1)
    slices = tuple(int(w) for w in lora.slices)
    num_slots, rows, r = lora.b.shape
    want = (n, n) if gated else None
    if gather or not 1 <= len(slices) <= MAX_SLICES or sum(slices) != rows:
        raise ValueError(f"lora: slices {slices} must cover B's {rows} rows (and no rows gather)")
    if (want is not None and slices != want) or (not gated and rows != n):
        raise ValueError(f"lora: B's rows {rows} (slices {slices}) do not fit the {n} outputs")
    s, scale, slots = lora.s, lora.scale, lora.slots
    if s.dim() != 3 or s.shape[1:] != (m, len(slices) * r) or s.dtype != torch.float32:
        raise ValueError(f"lora: s must be float32 [split, {m}, {len(slices) * r}], got {s.shape}")
    if scale.shape != (len(slices), num_slots) or scale.dtype != torch.float32:
        raise ValueError(f"lora: scale must be float32 [{len(slices)}, {num_slots}]")
    if slots.shape != (m,) or slots.dtype != torch.int32:
        raise ValueError(f"lora: slots must be int32 [{m}], got {slots.dtype} {list(slots.shape)}")
    for name, t in (("s", s), ("b", lora.b), ("scale", scale), ("slots", slots)):
        if t.stride(-1) != 1 or t.device != device:
            raise ValueError(f"lora: {name} must be on {device}, contiguous in its last dimension")
    ends = list(itertools.accumulate(slices))
    b2 = lora.b[:, n:] if gated else lora.b
    return dict(
        pointers=(s, lora.b, b2, scale, slots),
        scalars=(s.shape[0], s.stride(0), s.stride(1), lora.b.stride(0), lora.b.stride(1),
                 scale.stride(0), ends[0], ends[1] if len(ends) > 2 else rows, r),
        slices=len(slices),
        block_r=max(2, triton.next_power_of_2(r)),
    )  # fmt: skip
