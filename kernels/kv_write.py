"""Writing new keys and values into the paged KV cache by slot mapping.

`write_kv` (Triton) and `write_kv_ref` (pure torch, also the engine's CPU backend) do the same
thing: for each new token t with slot_mapping[t] = s >= 0, cache[s // block_size, s % block_size]
= key[t] (and likewise for value); tokens with slot -1 (padding, e.g. CUDA-graph bucket filler)
write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when this package's kernels were built for Triton's CPU interpreter.

    Triton picks compile-vs-interpret when @triton.jit runs (at import, from TRITON_INTERPRET), so
    ask the decorated kernel itself rather than the environment, which may have changed since.
    """
    # triton's own library (tl.cdiv, tl.sum, ...) is decorated when triton is imported: both must be
    # interpreted, or the kernels mix interpreted and compiled helpers
    return (
        type(_write_kv_kernel).__name__ == "InterpretedFunction"
        and type(tl.standard.cdiv).__name__ == "InterpretedFunction"
    )


def check_launchable(t: torch.Tensor, name: str) -> None:
    # Triton decides compile-vs-interpret when a kernel is decorated (module import), so a CPU
    # tensor without the interpreter would fail deep inside the launcher with a vague message.
    if t.device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{name} is a CPU tensor: Triton kernels need a GPU, or TRITON_INTERPRET=1 set before "
            "hf_paged.kernels is imported (use the *_ref functions on CPU otherwise)"
        )


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, Dk]
    value: torch.Tensor,  # [T, Hkv, Dv]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    slot_mapping: torch.Tensor,  # int64 [T]; -1 = padding, write nothing
) -> None:
    """Pure-torch reference (and the CPU backend): cache[slot // B, slot % B] = new token's K/V."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_k = key_cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, Dk]
    flat_v = value_cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, Dv]
    flat_k.index_copy_(0, slots, key[valid].to(key_cache.dtype))
    flat_v.index_copy_(0, slots, value[valid].to(value_cache.dtype))


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    value_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    slot_mapping_ptr,  # int64 [T]
    num_kv_heads,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,  # a value head's width (MLA: narrower than a key's)
    HEAD_DIM_V_PAD: tl.constexpr,
):
    # One program = one token x BLOCK_H kv heads: a [BLOCK_H, D] tile, one contiguous row per head.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)  # int64 scalar
    if slot < 0:
        return
    # int64 throughout: block_id * block stride exceeds 2^31 elements on large caches.
    block_id = slot // PAGE_SIZE
    block_off = slot % PAGE_SIZE
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    offs_h64 = offs_h.to(tl.int64)[:, None]

    k = tl.load(key_ptr + token * stride_k_t + offs_h64 * stride_k_h + offs_d[None, :], mask=mask)
    if HEAD_DIM_V == HEAD_DIM:
        offs_dv = offs_d
        mask_v = mask
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
        mask_v = (offs_h < num_kv_heads)[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    v_ptrs = value_ptr + token * stride_v_t + offs_h64 * stride_v_h + offs_dv[None, :]
    v = tl.load(v_ptrs, mask=mask_v)
    kc = key_cache_ptr + block_id * stride_kc_b + block_off * stride_kc_s + offs_h64 * stride_kc_h
    vc = value_cache_ptr + block_id * stride_vc_b + block_off * stride_vc_s + offs_h64 * stride_vc_h
    tl.store(kc + offs_d[None, :], k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_dv[None, :], v.to(value_cache_ptr.dtype.element_ty), mask=mask_v)


def check_kv_cache_pair(
    key_cache: torch.Tensor, value_cache: torch.Tensor, same_head_dim: bool = True
) -> None:
    """The kernels' cache layout: [num_blocks, block_size, num_kv_heads, head_dim], K and V
    alike; with same_head_dim=False (write_kv, paged_attention) a value head may be narrower or
    wider than a key head."""
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], "
                f"got {tuple(t.shape)}"
            )
    compared = 4 if same_head_dim else 3
    if value_cache.shape[:compared] != key_cache.shape[:compared]:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
            f"{tuple(key_cache.shape)}" + ("" if same_head_dim else " in blocks or heads")
        )


def _check_kv_write_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    if key.dim() != 3:
        raise ValueError(
            f"key must be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)}"
        )
    if value.dim() != 3 or value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)} in tokens or heads"
        )
    check_kv_cache_pair(key_cache, value_cache, same_head_dim=False)
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key_cache heads/head_dim {tuple(key_cache.shape[2:])} != key's "
            f"{(num_kv_heads, head_dim)}"
        )
    if value_cache.shape[3] != value.shape[2]:
        raise ValueError(f"value_cache head_dim {value_cache.shape[3]} != value's {value.shape[2]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must be [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be float32/float16/bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1)")
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")
    if slot_mapping.device != key.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, key on {key.device}")
    check_launchable(key, "key")


def write_kv(
    key: torch.Tensor,  # [T, Hkv, Dk]
    value: torch.Tensor,  # [T, Hkv, Dv]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    slot_mapping: torch.Tensor,  # int64 [T]; -1 = padding, write nothing
) -> None:
    """Triton version of `write_kv_ref`: scatter each token's K/V rows into its cache slot.

    Inputs may be strided (e.g. views into a fused QKV projection); only head_dim must be
    contiguous. K/V are cast to the cache dtype. Slots are not bounds-checked on the device
    (that would need a host sync): the engine guarantees slot < num_blocks * block_size.
    """
    _check_kv_write_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if interpreting() and key_cache.dtype == torch.bfloat16 and key.dtype != torch.bfloat16:
        # Triton's interpreter truncates float32 -> bf16 (the GPU rounds to nearest even): cast
        # on the host there so CPU CI checks the GPU's bits.
        key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)
    head_dim_pad = triton.next_power_of_2(head_dim)
    head_dim_v = value.shape[2]
    # ~4K elements per program: one or a few 16-byte vectors per thread, enough bytes in flight.
    widest = max(head_dim_pad, triton.next_power_of_2(head_dim_v))
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // widest))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        PAGE_SIZE=key_cache.shape[1],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_H=block_h,
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=triton.next_power_of_2(head_dim_v),
        num_warps=4,
    )
