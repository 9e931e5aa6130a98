"""Rotary embedding of a step's queries and keys, and the K/V cache write, in one launch.

Between the q/k/v projection and attention, transformers runs apply_rotary_pos_emb (a few
elementwise kernels on q and k) and our attention op writes K/V into the paged cache (another
kernel): at batch 1 on the H200 each is a ~1-2 us launch for a few KB. This kernel reads the
fused projection's output [T, (Hq + 2 Hkv) * D] once: query heads are rotated into a [T, Hq, D]
output, key heads are rotated and, with the value heads, written to their cache slot (slot -1:
padding, nothing written).

With q_norm_weight / k_norm_weight (Qwen3), each query / key head is first RMS-normalised over
head_dim, as Qwen3RMSNorm (LlamaRMSNorm's rounding) does before apply_rotary_pos_emb.

Rotation as transformers' rotate_half convention computes it, op by op in the model dtype:
q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1) for the halves q1, q2 of a head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_gemv import gdc_launch_dependents, gdc_wait
from .gemv_math import rms_scale
from .host_math import next_power_of_2
from .kv_write import check_kv_cache_pair, check_launchable


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D]: transformers' apply_rotary_pos_emb for one tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_write_kv_ref(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]
    num_q_heads: int,
    q_norm_weight: torch.Tensor | None = None,  # [D]
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 0.0,
) -> torch.Tensor:  # rotated queries [T, Hq, D]
    from .fused_gemv import rms_norm_ref
    from .kv_write import write_kv_ref

    num_kv_heads, head_dim = key_cache.shape[2:]
    t = qkv.shape[0]
    q, k, v = qkv.view(t, -1, head_dim).split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm_weight is not None:
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    write_kv_ref(rotate_ref(k, cos, sin), v, key_cache, value_cache, slot_mapping)
    return rotate_ref(q, cos, sin)


@triton.jit
def rotate_halves(x1, x2, cos1, cos2, sin1, sin2, dt):
    """x * cos + rotate_half(x) * sin on a head's two halves (f32 values of model-dtype
    numbers), each product and the sum rounded to the model dtype as transformers rounds them."""
    o1 = (x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)
    o2 = (x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _rotate(base, cos1, cos2, sin1, sin2, offs, m, HALF: tl.constexpr, dt, nw_ptr, eps,
            HEAD_NORM: tl.constexpr):  # fmt: skip
    # m masks offs to HALF (a power-of-2 tile over a half of 40 or 48: head_dim 80 / 96)
    x1 = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=m, other=0.0).to(tl.float32)
    if HEAD_NORM:  # the head's RMSNorm (fp32 sum of squares, LlamaRMSNorm's rounding)
        sum_sq = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
        inv_rms = 1.0 / tl.sqrt(sum_sq / (2 * HALF) + eps)
        g1 = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g2 = tl.load(nw_ptr + HALF + offs, mask=m, other=0.0).to(tl.float32)
        x1 = rms_scale(x1 * inv_rms, g1, dt, False).to(tl.float32)
        x2 = rms_scale(x2 * inv_rms, g2, dt, False).to(tl.float32)
    return rotate_halves(x1, x2, cos1, cos2, sin1, sin2, dt)


@triton.jit
def _rope_kv_kernel(
    qkv_ptr,  # [T, (Hq + 2 Hkv) * D]
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D]
    q_ptr,  # [T, Hq, D] out
    kc_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    vc_ptr,
    slot_ptr,  # int64 [T]
    qn_ptr,  # [D]: q_norm weight (HEAD_NORM)
    kn_ptr,  # [D]: k_norm weight (HEAD_NORM)
    eps,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of 2
    PAGE_SIZE: tl.constexpr,
    HEAD_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    # one program = one token x one head (query heads first, then key/value heads)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    dt = q_ptr.dtype.element_ty
    offs = tl.arange(0, HALF_PAD)
    m = offs < HALF
    cos1 = tl.load(cos_ptr + t * stride_cos + offs, mask=m, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_cos + HALF + offs, mask=m, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_sin + offs, mask=m, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_sin + HALF + offs, mask=m, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    if h < NUM_Q_HEADS:
        o1, o2 = _rotate(
            row + h * 2 * HALF, cos1, cos2, sin1, sin2, offs, m, HALF, dt, qn_ptr, eps, HEAD_NORM
        )
        out = q_ptr + (t * NUM_Q_HEADS + h) * 2 * HALF
        tl.store(out + offs, o1, mask=m)
        tl.store(out + HALF + offs, o2, mask=m)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            j = h - NUM_Q_HEADS
            block_id = slot // PAGE_SIZE
            block_off = slot % PAGE_SIZE
            k1, k2 = _rotate(
                row + h * 2 * HALF,
                cos1,
                cos2,
                sin1,
                sin2,
                offs,
                m,
                HALF,
                dt,
                kn_ptr,
                eps,
                HEAD_NORM,
            )
            kc = kc_ptr + block_id * stride_kc_b + block_off * stride_kc_s + j * stride_kc_h
            cdt = kc_ptr.dtype.element_ty
            tl.store(kc + offs, k1.to(cdt), mask=m)
            tl.store(kc + HALF + offs, k2.to(cdt), mask=m)
            v = row + (h + NUM_KV_HEADS) * 2 * HALF
            vc = vc_ptr + block_id * stride_vc_b + block_off * stride_vc_s + j * stride_vc_h
            tl.store(vc + offs, tl.load(v + offs, mask=m).to(cdt), mask=m)
            tl.store(vc + HALF + offs, tl.load(v + HALF + offs, mask=m).to(cdt), mask=m)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    pdl: bool = False,
) -> torch.Tensor:
    """rope_write_kv_ref by one Triton launch (even head_dim, contiguous rows)."""
    check_kv_cache_pair(key_cache, value_cache)
    num_kv_heads, head_dim = key_cache.shape[2:]
    t = qkv.shape[0]
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [num_tokens, {width}] with contiguous rows (q, k, v heads of "
            f"{head_dim}), got {list(qkv.shape)} strides {qkv.stride()}"
        )
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.shape != (t, head_dim) or c.stride(1) != 1:
            raise ValueError(f"{name} must be [{t}, {head_dim}], got {list(c.shape)}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{t}], got {slot_mapping.dtype}")
    head_norm = q_norm_weight is not None
    if head_norm != (k_norm_weight is not None):
        raise ValueError("q_norm_weight and k_norm_weight come together")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (w.shape != (head_dim,) or w.dtype != qkv.dtype or w.stride(0) != 1):
            raise ValueError(f"{name} must be contiguous [{head_dim}] of {qkv.dtype}")
    check_launchable(qkv, "qkv")
    q = torch.empty((t, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _rope_kv_kernel[(t, num_q_heads + num_kv_heads)](
        qkv,
        cos,
        sin,
        q,
        key_cache,
        value_cache,
        slot_mapping,
        q_norm_weight if head_norm else qkv,
        k_norm_weight if head_norm else qkv,
        float(eps),
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        HALF_PAD=next_power_of_2(head_dim // 2),
        PAGE_SIZE=key_cache.shape[1],
        HEAD_NORM=head_norm,
        PDL=pdl,
        num_warps=1,
        **({"launch_pdl": True} if pdl else {}),
    )
    return q
