"""The LoRA of the small-batch GEMVs (kernels/fused_gemv.py, kernels/qkv_rope.py): each row's
delta (s[m] @ B[slot_m]^T) * scale[slot_m] added to the product where peft adds it, from the
rows' shrink (lora_rows_shrink, one launch per projection group) and the stacked B read inside
the GEMV, so a group's adapters cost one shrink launch and no expand. Here: the shrink, the
epilogue's inputs (LoraEpilogue), their checks and launch arguments, the device functions the
kernels call, and the torch reference."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2

try:  # Triton >= 3.3: programmatic dependent launch (see kernels/fused_gemv.py)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: pdl stays off
    gdc_launch_dependents = gdc_wait = None

MAX_SLICES = 3  # q/k/v
MAX_ROWS = 8  # small-batch kernels' rows at most: beyond, tensor-core GEMMs (cuBLAS) are the tool


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
def lora_prefetch(b_ptr, stride_bs, stride_bn, sc_ptr, stride_sc, slot_ptr, M, offs_n, n_mask,
                  E0, E1, R, FIRST: tl.constexpr, SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                  SR_PAD: tl.constexpr):  # fmt: skip
    # What the rows' deltas need besides the shrink: each row's slot, B[slot]'s rows offs_n
    # placed at the shrink's columns of each row's slice (slices FIRST.. FIRST + SLICES - 1: a
    # tile may straddle q/k/v) [BLOCK_M, BLOCK_N, SR_PAD] and the slice's scale [BLOCK_M,
    # BLOCK_N], zero for rows of no adapter. All of it is step inputs and weights: the kernels
    # load it before their PDL wait, so only the shrink's output is read after it (with x). A
    # row's slot, then its B, then each split of its shrink, each waiting for the one before,
    # took 11 us a layer at 1 row and 43 more a row (H200, 1.1B shape, 2026-12-04: one chain per
    # row and program wave).
    offs_m = tl.arange(0, BLOCK_M)
    slots = tl.load(slot_ptr + offs_m, mask=offs_m < M, other=-1)
    adapted = slots >= 0
    slot = tl.maximum(slots, 0).to(tl.int64)
    if SLICES == 1:
        part = offs_n * 0 + FIRST
    else:
        part = FIRST + (offs_n >= E0).to(tl.int32) + (offs_n >= E1).to(tl.int32)
    r = tl.arange(0, SR_PAD)[None, :] - part[:, None] * R  # [BLOCK_N, SR_PAD]: B's column
    valid = (r >= 0) & (r < R) & n_mask[:, None]
    ptrs = b_ptr + (offs_n.to(tl.int64) * stride_bn)[:, None] + r
    b = tl.load(
        ptrs[None, :, :] + (slot * stride_bs)[:, None, None],
        mask=adapted[:, None, None] & valid[None, :, :],
        other=0.0,
    )
    scale = tl.load(
        sc_ptr + part[None, :] * stride_sc + slot[:, None],
        mask=adapted[:, None] & n_mask[None, :],
        other=0.0,
    )
    return slots, b, scale


@triton.jit
def lora_s_row(s_ptr, m: tl.constexpr, M, SPLIT, stride_ss, stride_sm, SR,
               SPLIT_PAD: tl.constexpr, SR_PAD: tl.constexpr):  # fmt: skip
    # row m's shrink, its SPLIT partial sums at once [SPLIT_PAD, SR_PAD] (one load, not one a
    # split); rows past M read zeros
    offs_p = tl.arange(0, SPLIT_PAD)
    offs_c = tl.arange(0, SR_PAD)
    mask = (offs_p < SPLIT)[:, None] & (offs_c < SR)[None, :]
    if m != 0:
        mask = mask & ((offs_c * 0 + m) < M)[None, :]
    offs = offs_p[:, None] * stride_ss + m * stride_sm + offs_c[None, :]
    return tl.load(s_ptr + offs, mask=mask, other=0.0)


@triton.jit
def lora_row_delta(slots, b, scale, s_row, m: tl.constexpr, row_scale, dt):
    # row m's delta over the program's columns [BLOCK_N] (float32), and whether it has an
    # adapter: B[slot]'s columns times the row's shrink (its partial sums added, times
    # row_scale, rounded to the adapter's dtype as peft rounds lora_A's output), times the
    # scale
    h = (tl.sum(s_row, axis=0) * row_scale).to(dt).to(tl.float32)  # [SR_PAD]
    sel = tl.arange(0, slots.shape[0]) == m
    b_m = tl.sum(tl.where(sel[:, None, None], b.to(tl.float32), 0.0), axis=0)  # [BLOCK_N, SR_PAD]
    scale_m = tl.sum(tl.where(sel[:, None], scale, 0.0), axis=0)
    adapted = tl.sum(tl.where(sel & (slots >= 0), 1, 0), axis=0) > 0
    return tl.sum(b_m * h[None, :], axis=1) * scale_m, adapted


def lora_launch_args(lora: LoraEpilogue | None, m: int, n: int, gated: bool, gather: bool, device):
    """The kernel's LoRA arguments (checked), or those of no LoRA."""
    if lora is None:
        return dict(pointers=None, scalars=(1, 0, 0, 0, 0, 0, 0, 0, 1), slices=0, split_pad=1,
                    sr_pad=1)  # fmt: skip
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
        split_pad=next_power_of_2(s.shape[0]),
        sr_pad=max(2, next_power_of_2(len(slices) * r)),
    )  # fmt: skip


ROWS_SHRINK_TILE = 8192  # A's elements a program holds: 64 float32 registers a thread at 4 warps
MAX_PARTIALS = 2048  # split x slices * R: the floats an epilogue program reads for a row


@triton.jit(do_not_specialize=["M"])
def _rows_shrink_kernel(
    x_ptr,  # [M, K]
    a_ptr,  # [S, SR, K] stacked A
    s_ptr,  # f32 [SPLIT, M, SR]
    slot_ptr,  # int32 [M], -1: none
    nw_ptr,  # [K] RMSNorm weight (NORM)
    M,
    K,
    SR,
    stride_xm,
    stride_as,
    stride_ar,
    stride_ss,
    stride_sm,
    K_PER: tl.constexpr,
    C_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NORM: tl.constexpr,
    NORM_PLUS_ONE: tl.constexpr,
    PDL: tl.constexpr,
):
    # program (c, k): columns [c * C_TILE, +C_TILE) of the rows' shrinks over inputs
    # [k * K_PER, +K_PER). Row 0's tile of A (a weight; its slot a step input) is loaded before
    # the PDL wait, so after it the program only reads x and multiplies: this launch sits on the
    # layer's critical path between two GEMVs.
    pid_c = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    offs_c = pid_c * C_TILE + tl.arange(0, C_TILE)
    offs_k = pid_k * K_PER + tl.arange(0, K_PER)
    c_mask = offs_c < SR
    k_mask = offs_k < K
    tile_mask = c_mask[:, None] & k_mask[None, :]
    a_offs = offs_c.to(tl.int64)[:, None] * stride_ar + offs_k[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    slots = tl.maximum(tl.load(slot_ptr + offs_m, mask=offs_m < M, other=0), 0).to(tl.int64)
    slot0 = tl.sum(tl.where(offs_m == 0, slots, 0), axis=0)
    a_next = tl.load(a_ptr + slot0 * stride_as + a_offs, mask=tile_mask, other=0.0)
    if NORM:
        g = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if NORM_PLUS_ONE:
            g = 1.0 + g
    if PDL:
        gdc_wait()  # x comes from the previous kernel
    for m in tl.static_range(BLOCK_M):
        a = a_next
        if m + 1 < BLOCK_M:  # row m + 1's tile (rows of one adapter: an L2 hit)
            row_ok = ((offs_k * 0 + m + 1) < M)[None, :]
            slot = tl.sum(tl.where(offs_m == m + 1, slots, 0), axis=0)
            a_next = tl.load(a_ptr + slot * stride_as + a_offs, mask=tile_mask & row_ok, other=0.0)
        if m == 0 or m < M:  # rows of no adapter take slot 0's: finite, and never used
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0.0)
            if NORM:  # x * g in the adapter's dtype, as lora_shrink (the GEMV applies 1 / rms)
                x = x.to(tl.float32) * g
            x = x.to(a.dtype).to(tl.float32)
            s = tl.sum(a.to(tl.float32) * x[None, :], axis=1)
            tl.store(s_ptr + pid_k * stride_ss + m * stride_sm + offs_c, s, mask=c_mask)


def rows_shrink_tiles(k: int, sr: int) -> tuple[int, int]:
    """(C_TILE, K_PER) of lora_rows_shrink: at most ROWS_SHRINK_TILE elements of A a program,
    inputs split so that an epilogue row reads at most MAX_PARTIALS partial sums."""
    sr_pad = max(2, next_power_of_2(sr))
    k_per = min(next_power_of_2(k), max(64, ROWS_SHRINK_TILE // min(sr_pad, 16)))
    while next_power_of_2(cdiv(k, k_per)) * sr_pad > MAX_PARTIALS:
        k_per *= 2
    return max(1, min(sr_pad, ROWS_SHRINK_TILE // k_per)), k_per


def lora_rows_shrink(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    a_stack: torch.Tensor,  # [S, SR, K]
    slots: torch.Tensor,  # int32 [M], -1: no adapter
    *,
    norm_weight: torch.Tensor | None = None,
    norm_plus_one: bool = False,
    pdl: bool = False,
) -> torch.Tensor:  # f32 [SPLIT, M, SR]
    """lora_shrink for the small-batch forward's few rows, as LoraEpilogue.s: x @ A[slot]^T
    (norm_weight: (x * norm_weight) @ A[slot]^T, the GEMV multiplying in each row's 1 / rms) as
    partial sums over the input dimension. Each row reads its own slot's A (no grouping by
    slot, which costs a sort a step and a program per slot), and every row is written (rows of
    no adapter: slot 0's product, which the epilogue does not use)."""
    if x.dim() != 2 or a_stack.dim() != 3 or a_stack.shape[2] != x.shape[1]:
        raise ValueError(f"a_stack {tuple(a_stack.shape)} does not fit x {tuple(x.shape)}")
    m, k = x.shape
    sr = a_stack.shape[1]
    if m > MAX_ROWS or slots.shape != (m,) or slots.dtype != torch.int32:
        raise ValueError(
            f"slots must be int32 [{m}] for at most {MAX_ROWS} rows, got {slots.dtype} "
            f"{list(slots.shape)}"
        )
    if x.stride(1) != 1 or a_stack.stride(2) != 1:
        raise ValueError("x and a_stack must be contiguous in their last dimension")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"norm_weight must be [{k}] of {x.dtype}")
    c_tile, k_per = rows_shrink_tiles(k, sr)
    split = cdiv(k, k_per)
    s = torch.empty((split, m, sr), dtype=torch.float32, device=x.device)
    if m == 0:
        return s
    _rows_shrink_kernel[(cdiv(sr, c_tile), split)](
        x, a_stack, s, slots, norm_weight if norm_weight is not None else x,
        m, k, sr, x.stride(0), a_stack.stride(0), a_stack.stride(1), s.stride(0), s.stride(1),
        K_PER=k_per, C_TILE=c_tile, BLOCK_M=next_power_of_2(m),
        NORM=norm_weight is not None, NORM_PLUS_ONE=norm_plus_one, PDL=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return s
