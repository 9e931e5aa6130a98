"""Multi-LoRA shrink and expand: every token of a flat batch gets its own adapter's
y[t] += (x[t] @ A[slot_t]^T) @ B[slot_t]^T * scale[slot_t], in two launches per projection.

Adapters live in stacked buffers, one slot each: A [S, R, in] and B [S, out, R], zero-padded to
the largest rank R (a zero row of A and column of B add exact zeros, so any rank up to R, powers
of two or not, computes the same sums). Each token carries a slot index, -1 for none (its row of
y is not touched).

The kernels read tokens grouped by slot (vLLM's V1 punica kernels do the same): `lora_segments`
sorts the token indices by slot once per step (sorted_tokens, slot_start), and the grid runs one
axis over slots; a program whose slot has fewer tokens than its tile start returns at once. So
one launch covers any mix of prefill chunks (long runs of one slot, SGMV's case) and decode rows
(BGMV's case), and the grid's size depends only on the token count and the slot count (static
under CUDA graphs).

shrink splits the input dimension over SPLIT_K programs and writes SPLIT_K partial products;
expand sums them when it loads them. A decode step has a handful of tokens: without the split,
one program would walk a whole 4096-wide slot of A alone, with it the reads spread over 16.
The sum is in a fixed order (no atomics): the result does not vary between runs.

Groups: a fused projection (q/k/v as one [q | k | v] product, gate/up as one) takes one shrink
over its slices' A stacked along the rank ([S, slices * R, in]) and one expand over its product:
`slices` gives each slice's width, B is [S, sum(widths), R] (each output column reads its own
slice's R columns of the shrink's output) and scale [slices, S]. Expand tiles never straddle two
slices, so each program still makes one dot. The small-batch forward adds the same deltas inside
its GEMVs instead (kernels/lora_epilogue.py): one shrink launch per group, no expand.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_power_of_2
from .kv_write import check_launchable
from .lora_epilogue import MAX_SLICES, LoraEpilogue, lora_epilogue_ref  # noqa: F401 (re-exported)

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# Arguments that follow the step's token count (the split, the partial products' stride) are not
# specialised: Triton would compile a variant per value class, inside whichever step met it first
@triton.jit(do_not_specialize=["stride_os", "K_PER_SPLIT"])
def _lora_shrink_kernel(
    x_ptr,  # [T, K] activations
    a_ptr,  # [S, R, K] stacked A
    out_ptr,  # f32 [SPLIT_K, T, R]
    sorted_ptr,  # int32 [T] token indices grouped by slot
    start_ptr,  # int32 [S + 1] slot s owns sorted_tokens[start[s]:start[s + 1]]
    K,
    R,
    stride_xt,
    stride_as,
    stride_ar,
    stride_os,
    stride_ot,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    slot = tl.program_id(2)
    begin = tl.load(start_ptr + slot)
    end = tl.load(start_ptr + slot + 1)
    m0 = begin + pid_m * BLOCK_M
    if m0 < end:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        tokens = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_begin = pid_k * K_PER_SPLIT
        for k in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            xt = tl.load(
                x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            at = tl.load(
                a_base + offs_r[:, None] * stride_ar + offs_k[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            xt = xt.to(at.dtype)
            if DOT_UPCAST:
                xt, at = xt.to(tl.float32), at.to(tl.float32)
            acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + pid_k * stride_os + tokens[:, None] * stride_ot + offs_r[None, :],
            acc,
            mask=m_mask[:, None] & r_mask[None, :],
        )


@triton.jit(do_not_specialize=["stride_ss", "SPLIT_K"])
def _lora_expand_kernel(
    y_ptr,  # [T, N0 + N1 + N2] the base product, updated in place
    s_ptr,  # f32 [SPLIT_K, T, SLICES * R] shrink's partial products, or [T, S * SLICES * R]
    b_ptr,  # [S, N0 + N1 + N2, R] stacked B, each slice's rows in turn
    scale_ptr,  # f32 [SLICES, S]
    sorted_ptr,  # int32 [T]
    start_ptr,  # int32 [S + 1]
    N0,  # the slices' widths (0: no such slice)
    N1,
    N2,
    R,
    stride_yt,
    stride_ss,
    stride_st,
    stride_sslot,  # 0: s holds each token's own slot; SLICES * R: every slot's, in turn
    stride_bs,
    stride_bn,
    stride_ci,  # scale's stride between slices
    SPLIT_K,  # a run-time loop bound: the split follows the token count (_split_k)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    begin = tl.load(start_ptr + slot)
    end = tl.load(start_ptr + slot + 1)
    m0 = begin + pid_m * BLOCK_M
    if m0 < end:
        # axis 1 runs over each slice's column tiles in turn: a tile lies in one slice, so its
        # rows of B all read that slice's R columns of s (one dot)
        tiles0 = tl.cdiv(N0, BLOCK_N)
        tiles1 = tiles0 + tl.cdiv(N1, BLOCK_N)
        in1 = pid_n >= tiles0
        in2 = pid_n >= tiles1
        part = in1.to(tl.int32) + in2.to(tl.int32)
        col0 = tl.where(in2, N0 + N1, tl.where(in1, N0, 0))
        tile0 = tl.where(in2, tiles1, tl.where(in1, tiles0, 0))
        width = tl.where(in2, N2, tl.where(in1, N1, N0))
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        tokens = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        s_mask = m_mask[:, None] & r_mask[None, :]
        s_cols = slot * stride_sslot + part * R + offs_r
        s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for i in range(SPLIT_K):
            s += tl.load(
                s_ptr + i * stride_ss + tokens[:, None] * stride_st + s_cols[None, :],
                mask=s_mask,
                other=0.0,
            )
        offs_n = col0 + (pid_n - tile0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col0 + width
        b = tl.load(
            b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        # peft rounds lora_A's output to the adapter's dtype before lora_B: so do we
        s = s.to(b.dtype)
        if DOT_UPCAST:
            s, b = s.to(tl.float32), b.to(tl.float32)
        delta = tl.dot(s, tl.trans(b), input_precision=DOT_PRECISION)
        delta = delta * tl.load(scale_ptr + part * stride_ci + slot)
        y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=y_mask)


def lora_segments(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_tokens int32 [T], slot_start int32 [num_slots + 1]) of token_slots (int [T], -1:
    no adapter), on its device, without a host sync (scatter_add, not bincount, whose CUDA
    version reads its maximum on the host). Tokens without an adapter sort last, outside every
    slot's range."""
    t = token_slots.shape[0]
    key = torch.where(token_slots < 0, num_slots, token_slots).long()
    sorted_tokens = torch.sort(key, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=token_slots.device)
    counts.scatter_add_(0, key, torch.ones(t, dtype=torch.int32, device=token_slots.device))
    slot_start = torch.zeros(num_slots + 1, dtype=torch.int32, device=token_slots.device)
    slot_start[1:] = counts[:num_slots].cumsum(0)
    return sorted_tokens, slot_start


def _check_stack(name: str, t: torch.Tensor, dims: int = 3) -> None:
    if t.dim() != dims or t.stride(-1) != 1 or t.dtype not in _FLOATS:
        raise ValueError(
            f"{name} must be a float {dims}-d tensor with a contiguous last dimension, got "
            f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )


def _check_segments(sorted_tokens, slot_start, num_tokens: int, num_slots: int) -> None:
    if sorted_tokens.dtype != torch.int32 or sorted_tokens.shape != (num_tokens,):
        raise ValueError(
            f"sorted_tokens must be int32 [{num_tokens}], got {sorted_tokens.dtype} "
            f"{tuple(sorted_tokens.shape)}"
        )
    if slot_start.dtype != torch.int32 or slot_start.shape != (num_slots + 1,):
        raise ValueError(
            f"slot_start must be int32 [{num_slots + 1}], got {slot_start.dtype} "
            f"{tuple(slot_start.shape)}"
        )


def _upcast(stack: torch.Tensor) -> bool:
    # Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits: upcast there
    # (the products of two bf16 values are exact in float32, so nothing else changes)
    return stack.dtype == torch.bfloat16 and stack.device.type == "cpu"


def _precision(stack: torch.Tensor) -> str:
    return "ieee" if stack.dtype == torch.float32 or _upcast(stack) else "tf32"


def _split_k(num_tokens: int, k: int, block_m: int, block_k: int) -> int:
    """Programs along the input dimension: enough for ~128 programs when the token tiles are
    few (decode), never a split shorter than 2 BLOCK_K steps."""
    tiles = -(-num_tokens // block_m)
    return max(1, min(k // (2 * block_k), 128 // tiles))


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a_stack: torch.Tensor,  # [S, R, in]
    sorted_tokens: torch.Tensor,  # int32 [T]
    slot_start: torch.Tensor,  # int32 [S + 1]
    *,
    split_k: int | None = None,
) -> torch.Tensor:  # f32 [SPLIT_K, T, R]; rows of tokens without an adapter are not written
    """x @ A[slot]^T for each token with a slot, as SPLIT_K partial sums (lora_expand sums
    them). The small-batch forward's few rows take lora_epilogue.lora_rows_shrink instead."""
    _check_stack("x", x, 2)
    _check_stack("a_stack", a_stack)
    check_launchable(x, "x")
    t, k = x.shape
    num_slots, r, k_a = a_stack.shape
    if k_a != k or a_stack.device != x.device:
        raise ValueError(f"a_stack {tuple(a_stack.shape)} does not fit x {tuple(x.shape)}")
    _check_segments(sorted_tokens, slot_start, t, num_slots)
    # 128-wide input steps, 8 warps: from a sweep of the H200 (2x at prefill chunks' sizes)
    block_m = 16 if t <= 256 else 64
    block_k = 128 if k >= 1024 else 64 if k >= 64 else max(16, next_power_of_2(k))
    split = split_k or _split_k(t, k, block_m, block_k)
    k_per_split = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_per_split)  # no program with an empty range
    out = torch.empty((split, t, r), dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    grid = (cdiv(t, block_m), split, num_slots)
    _lora_shrink_kernel[grid](
        x, a_stack, out, sorted_tokens, slot_start, k, r, x.stride(0), a_stack.stride(0),
        a_stack.stride(1), out.stride(0), out.stride(1), k_per_split,
        BLOCK_M=block_m,
        BLOCK_R=max(16, next_power_of_2(r)),
        BLOCK_K=block_k,
        DOT_PRECISION=_precision(a_stack),
        DOT_UPCAST=_upcast(a_stack),
        num_warps=8,
    )  # fmt: skip
    return out


def _slices(widths: Sequence[int] | None, n: int) -> tuple[int, ...]:
    widths = tuple(int(w) for w in (widths or (n,)))
    if not 1 <= len(widths) <= MAX_SLICES or sum(widths) != n or min(widths) < 0:
        raise ValueError(
            f"slices must be 1 to {MAX_SLICES} widths summing to the product's {n} columns, "
            f"got {widths}"
        )
    return widths


def _check_scale(scale: torch.Tensor, slices: int, num_slots: int) -> torch.Tensor:
    """scale as [slices, S] (a one-slice [S] is viewed so)."""
    if scale.dim() == 1 and slices == 1:
        scale = scale[None]
    if scale.shape != (slices, num_slots) or scale.dtype != torch.float32 or scale.stride(-1) != 1:
        raise ValueError(
            f"scale must be float32 [{num_slots}] or [{slices}, {num_slots}] (one row a slice), "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    return scale


def lora_expand(
    y: torch.Tensor,  # [T, out], updated in place
    s: torch.Tensor,  # f32 [SPLIT_K, T, slices * R] from lora_shrink
    b_stack: torch.Tensor,  # [S, out, R]
    scale: torch.Tensor,  # f32 [S], or [slices, S]
    sorted_tokens: torch.Tensor,  # int32 [T]
    slot_start: torch.Tensor,  # int32 [S + 1]
    slices: Sequence[int] | None = None,
) -> None:
    """y[t] += s[t] @ B[slot_t]^T * scale[slot_t] for each token with a slot. With slices (the
    widths of y's column slices, in order, at most 3): slice i's columns take s's columns
    [i * R, (i + 1) * R) and scale[i]: one launch for a fused projection's whole product."""
    t, widths, scale = _check_expand(y, b_stack, slices, scale, sorted_tokens, slot_start)
    rs = len(widths) * b_stack.shape[2]
    if s.dim() != 3 or s.shape[1:] != (t, rs) or s.dtype != torch.float32 or s.stride(-1) != 1:
        raise ValueError(f"s must be float32 [split, {t}, {rs}], got {s.dtype} {tuple(s.shape)}")
    split = (s.shape[0], s.stride(0))
    _launch_expand(y, s, split, 0, b_stack, scale, sorted_tokens, slot_start, widths)


def lora_expand_folded(
    y: torch.Tensor,  # [T, out], updated in place
    s_all: torch.Tensor,  # [T, S * slices * R]: x @ A^T for every slot (the base GEMM's rows)
    b_stack: torch.Tensor,  # [S, out, R]
    scale: torch.Tensor,  # f32 [S], or [slices, S]
    sorted_tokens: torch.Tensor,  # int32 [T]
    slot_start: torch.Tensor,  # int32 [S + 1]
    slices: Sequence[int] | None = None,
    *,
    check: bool = True,
) -> None:
    """lora_expand where the shrink came out of the base product: s_all holds every slot's
    x @ A^T (slot-major, then slice, then rank), in the product's dtype, and each token reads its
    own slot's columns. hf_paged/lora/fold.py says when a projection computes it so.

    check=False skips the arguments' checks (~20 us of host time a call): for a caller that
    built every argument to fit, scale as [slices, S] (the engine's LoRA op, once per projection
    of every eager prefill step, hf_paged/lora/fold.py)."""
    num_slots, _, r = b_stack.shape
    if check:
        t, widths, scale = _check_expand(y, b_stack, slices, scale, sorted_tokens, slot_start)
        rs = len(widths) * r
        if s_all.shape != (t, num_slots * rs) or s_all.stride(-1) != 1 or s_all.dtype != y.dtype:
            raise ValueError(
                f"s_all must be {y.dtype} [{t}, {num_slots * rs}] with a contiguous last "
                f"dimension, got {s_all.dtype} {tuple(s_all.shape)} strides {s_all.stride()}"
            )
    else:
        widths = tuple(slices) if slices else (y.shape[1],)
    slot_stride = len(widths) * r
    _launch_expand(y, s_all, (1, 0), slot_stride, b_stack, scale, sorted_tokens, slot_start, widths)


def _check_expand(y, b_stack, slices, scale, sorted_tokens, slot_start):
    """(token count, slice widths, scale as [slices, S]) of a valid expand into y (s is checked
    by each caller: its layout differs)."""
    _check_stack("y", y, 2)
    _check_stack("b_stack", b_stack)
    check_launchable(y, "y")
    t, n = y.shape
    if b_stack.shape[1] != n or b_stack.device != y.device:
        raise ValueError(f"b_stack {tuple(b_stack.shape)} does not fit y {tuple(y.shape)}")
    widths = _slices(slices, n)
    num_slots = b_stack.shape[0]
    _check_segments(sorted_tokens, slot_start, t, num_slots)
    return t, widths, _check_scale(scale, len(widths), num_slots)


def _launch_expand(
    y, s, split, slot_stride, b_stack, scale, sorted_tokens, slot_start, widths
) -> None:
    """The expand's launch, on arguments already checked or built to fit (split: the count of
    s's partial sums and their stride; s's last two dimensions are [T, columns])."""
    t = y.shape[0]
    if t == 0:
        return
    num_slots, _, r = b_stack.shape
    # tiles from a sweep of the H200 (evals/RESULTS.md): 16 x 128, or 16 x 256 on wide slices,
    # for decode's few tokens a slot; 64 x 256 for prefill chunks
    block_m = 16 if t <= 256 else 64
    wide = t > 256 or max(widths) >= 4096
    block_n = min(256 if wide else 128, max(16, next_power_of_2(max(widths))))
    n0, n1, n2 = (*widths, 0, 0)[:3]
    tiles = sum(cdiv(w, block_n) for w in widths)
    grid = (cdiv(t, block_m), tiles, num_slots)
    _lora_expand_kernel[grid](
        y, s, b_stack, scale, sorted_tokens, slot_start,
        n0, n1, n2, r, y.stride(0), split[1], s.stride(-2), slot_stride, b_stack.stride(0),
        b_stack.stride(1), scale.stride(0),
        SPLIT_K=split[0],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=max(16, next_power_of_2(r)),
        DOT_PRECISION=_precision(b_stack),
        DOT_UPCAST=_upcast(b_stack),
        num_warps=4,
    )  # fmt: skip


def _slot_tokens(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, the indices of its tokens) for each slot some token uses (a host sync)."""
    used = torch.unique(token_slots[token_slots >= 0]).tolist()
    return [(slot, (token_slots == slot).nonzero().squeeze(1)) for slot in used]


def lora_shrink_ref(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_plus_one: bool = False,
) -> torch.Tensor:  # f32 [T, R]; zero where a token has no slot
    """x @ A[slot]^T per token (of x * norm_weight with norm_weight, as lora_rows_shrink), in
    the adapters' dtype: each used slot's tokens gathered (the engine runs this inside an opaque
    custom op, so the data-dependent shapes never reach torch.compile or a graph)."""
    if norm_weight is not None:
        x = x.float() * (norm_weight.float() + (1.0 if norm_plus_one else 0.0))
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot, index in _slot_tokens(token_slots):
        h = x.index_select(0, index).to(a_stack.dtype) @ a_stack[slot].T
        out.index_copy_(0, index, h.float())
    return out


def own_slot_columns(s_all: torch.Tensor, token_slots: torch.Tensor, width: int) -> torch.Tensor:
    """f32 [T, width]: each token's own slot's columns of s_all ([T, S * width], slot-major),
    zero for tokens without a slot (lora_expand_folded's reads, for lora_expand_ref)."""
    t = s_all.shape[0]
    per_slot = s_all.reshape(t, -1, width)
    index = token_slots.clamp(min=0).long()[:, None, None].expand(t, 1, width)
    own = per_slot.gather(1, index)[:, 0].float()
    return torch.where(token_slots[:, None] >= 0, own, 0.0)


def lora_expand_ref(
    y: torch.Tensor,
    s: torch.Tensor,  # f32 [T, slices * R], or [SPLIT_K, T, slices * R] partial sums
    b_stack: torch.Tensor,
    scale: torch.Tensor,  # [S] or [slices, S]
    token_slots: torch.Tensor,
    slices: Sequence[int] | None = None,
) -> torch.Tensor:
    """y + s @ B[slot]^T * scale[slot] per token (rows without a slot: y as it is), as peft
    computes result + lora_B(lora_A(x)) * scaling; with slices, each column slice from its own
    R columns of s and its own scale."""
    if s.dim() == 3:
        s = s.sum(0)
    widths = _slices(slices, y.shape[-1])
    scale = scale[None] if scale.dim() == 1 else scale
    r = b_stack.shape[-1]
    out = y.clone()
    start = 0
    for i, width in enumerate(widths):
        cols = slice(start, start + width)
        for slot, index in _slot_tokens(token_slots):
            h = s[:, i * r : (i + 1) * r].index_select(0, index).to(b_stack.dtype)
            delta = (h @ b_stack[slot, cols].T) * scale[i, slot].to(b_stack.dtype)
            out[:, cols] = out[:, cols].index_add(0, index, delta.to(y.dtype))
        start += width
    return out
