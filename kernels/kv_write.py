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

from .host_math import cdiv, next_power_of_2

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# FP8 caches (hf_paged/quantization/kv_cache.py): each layer's K and V are stored divided by a
# per-tensor scale, saturated to the format's largest finite value (a float -> float8 cast
# overflows to NaN or inf otherwise).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_CACHE_DTYPES = _FLOAT_DTYPES + tuple(FP8_MAX)


def quantize_ref(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """x / scale in the cache dtype, saturated for FP8 (a no-op cast for the float dtypes);
    scale a float or a tensor broadcasting against x."""
    fmax = FP8_MAX.get(dtype)
    if fmax is None:
        return x.to(dtype)
    # times the reciprocal, as the kernel computes it (a division rounds differently at ties)
    return (x.float() * (1.0 / scale)).clamp(-fmax, fmax).to(dtype)


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
    k_scale: float = 1.0,  # FP8 caches: stored = key / k_scale (saturated)
    v_scale: float = 1.0,
) -> None:
    """Pure-torch reference (and the CPU backend): cache[slot // B, slot % B] = new token's K/V."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for new, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = quantize_ref(new[valid], cache.dtype, scale)
        flat = cache.flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
        if cache.dtype in FP8_MAX:  # index_copy_ has no float8 kernels: copy the bytes
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slots, rows)


@triton.jit(do_not_specialize=["num_tokens"])  # it varies step to step
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    value_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    slot_mapping_ptr,  # int64 [T]
    num_tokens,
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
    k_inv_scale,  # FP8 only: 1 / k_scale
    v_inv_scale,
    FP8_MAX: tl.constexpr,  # > 0: an FP8 cache, stored scaled and saturated
    BLOCK_T: tl.constexpr,  # tokens a program: 1 on a GPU (write_kv)
):
    # One program = BLOCK_T tokens x BLOCK_H kv heads: [BLOCK_T, BLOCK_H, D] tiles, one
    # contiguous row per token and head. Padding tokens (slot -1) load and store nothing.
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    # int64 throughout: block_id * block stride exceeds 2^31 elements on large caches.
    block_id = (slot // PAGE_SIZE)[:, None, None]
    block_off = (slot % PAGE_SIZE)[:, None, None]
    tok = offs_t[:, None, None]
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_h64 = offs_h.to(tl.int64)[None, :, None]
    rows = ((slot >= 0)[:, None] & (offs_h < num_kv_heads)[None, :])[:, :, None]
    offs_d = tl.arange(0, HEAD_DIM_PAD)[None, None, :]
    mask = rows & (offs_d < HEAD_DIM)

    k = tl.load(key_ptr + tok * stride_k_t + offs_h64 * stride_k_h + offs_d, mask=mask)
    if HEAD_DIM_V == HEAD_DIM:
        offs_dv = offs_d
        mask_v = mask
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)[None, None, :]
        mask_v = rows & (offs_dv < HEAD_DIM_V)
    v = tl.load(value_ptr + tok * stride_v_t + offs_h64 * stride_v_h + offs_dv, mask=mask_v)
    kc = key_cache_ptr + block_id * stride_kc_b + block_off * stride_kc_s + offs_h64 * stride_kc_h
    vc = value_cache_ptr + block_id * stride_vc_b + block_off * stride_vc_s + offs_h64 * stride_vc_h
    if FP8_MAX > 0:
        k = tl.clamp(k.to(tl.float32) * k_inv_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * v_inv_scale, -FP8_MAX, FP8_MAX)
    tl.store(kc + offs_d, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_dv, v.to(value_cache_ptr.dtype.element_ty), mask=mask_v)


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


def check_kv_scales(k_scale: float, v_scale: float) -> None:
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(x, (int, float)) and 0.0 < x < float("inf")):
            raise ValueError(f"{name} must be a positive finite float, got {x!r}")


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
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} != key_cache's {key_cache.dtype}")
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        allowed = _CACHE_DTYPES if name.endswith("cache") else _FLOAT_DTYPES
        if t.dtype not in allowed:
            raise ValueError(f"{name} dtype must be one of {allowed}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1)")
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")
    if slot_mapping.device != key.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, key on {key.device}")
    check_launchable(key, "key")


def tokens_per_program(num_tokens: int) -> int:
    """The KV write's tokens a program: one on a GPU, where programs run side by side; many
    under the CPU interpreter, which runs programs one after another, each as numpy arrays
    (same results)."""
    return min(64, next_power_of_2(num_tokens)) if interpreting() else 1


def write_kv(
    key: torch.Tensor,  # [T, Hkv, Dk]
    value: torch.Tensor,  # [T, Hkv, Dv]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    slot_mapping: torch.Tensor,  # int64 [T]; -1 = padding, write nothing
    k_scale: float = 1.0,  # FP8 caches: stored = key / k_scale (saturated)
    v_scale: float = 1.0,
) -> None:
    """Triton version of `write_kv_ref`: scatter each token's K/V rows into its cache slot.

    Inputs may be strided (e.g. views into a fused QKV projection); only head_dim must be
    contiguous. K/V are cast to the cache dtype. Slots are not bounds-checked on the device
    (that would need a host sync): the engine guarantees slot < num_blocks * block_size.
    """
    _check_kv_write_args(key, value, key_cache, value_cache, slot_mapping)
    check_kv_scales(k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if interpreting() and key_cache.dtype == torch.bfloat16 and key.dtype != torch.bfloat16:
        # Triton's interpreter truncates float32 -> bf16 (the GPU rounds to nearest even): cast
        # on the host there so CPU CI checks the GPU's bits.
        key, value = key.to(torch.bfloat16), value.to(torch.bfloat16)
    fp8_max = FP8_MAX.get(key_cache.dtype, 0.0)
    if interpreting() and fp8_max:
        # Triton's interpreter rounds float -> float8 wrongly (no carry into the exponent,
        # ties away from even): quantise on the host there, as the GPU rounds, and let the
        # kernel copy the bytes. The kernel's own scaling runs on the GPU (tests marked gpu).
        key = quantize_ref(key, key_cache.dtype, k_scale)
        value = quantize_ref(value, value_cache.dtype, v_scale)
        k_scale = v_scale = 1.0
        fp8_max = 0.0
    head_dim_pad = next_power_of_2(head_dim)
    head_dim_v = value.shape[2]
    # ~4K elements per program: one or a few 16-byte vectors per thread, enough bytes in flight.
    widest = max(head_dim_pad, next_power_of_2(head_dim_v))
    block_h = min(next_power_of_2(num_kv_heads), max(1, 4096 // widest))
    block_t = tokens_per_program(num_tokens)
    grid = (cdiv(num_tokens, block_t), cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
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
        HEAD_DIM_V_PAD=next_power_of_2(head_dim_v),
        k_inv_scale=1.0 / k_scale,
        v_inv_scale=1.0 / v_scale,
        FP8_MAX=fp8_max,
        BLOCK_T=block_t,
        num_warps=4,
    )
