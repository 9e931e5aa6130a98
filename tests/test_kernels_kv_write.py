"""write_kv (Triton) against write_kv_ref.

Runs in Triton's CPU interpreter when no GPU is there (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported).
"""

from __future__ import annotations

import importlib

import pytest
import torch

ON_GPU = torch.cuda.is_available()

kv_write_mod = importlib.import_module("hf_paged.kernels.kv_write")

# tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported when there is no GPU.
if not ON_GPU and not kv_write_mod.interpreting():
    raise RuntimeError(
        "no GPU and the kernels are not interpreted: TRITON_INTERPRET=1 was not set "
        "before triton was imported (tests/conftest.py sets it)"
    )


write_kv = kv_write_mod.write_kv
write_kv_ref = kv_write_mod.write_kv_ref
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(
    num_tokens,
    num_kv_heads,
    head_dim,
    num_blocks,
    block_size,
    in_dtype,
    cache_dtype,
    pad_every=3,
    seed=0,
):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(in_dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(in_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if pad_every:
        slots[::pad_every] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # a sentinel, not zeros: a stray write of a padding token must show
    key_cache = torch.full(shape, 7.0, dtype=cache_dtype)
    value_cache = torch.full(shape, -7.0, dtype=cache_dtype)
    return [t.to(DEVICE) for t in (key, value, key_cache, value_cache, slots)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_kv_heads, head_dim, block_size", [(2, 64, 16), (3, 80, 32), (1, 96, 16), (8, 128, 64)]
)
def test_matches_ref(dtype, num_kv_heads, head_dim, block_size):
    key, value, kc, vc, slots = _case(11, num_kv_heads, head_dim, 4, block_size, dtype, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv(key, value, kc, vc, slots)
    write_kv_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_one_token_a_program_as_on_a_gpu(monkeypatch):
    # the interpreter writes many tokens a program, a GPU one: that tile here too
    monkeypatch.setattr(kv_write_mod, "tokens_per_program", lambda num_tokens: 1)
    key, value, kc, vc, slots = _case(11, 3, 80, 4, 16, torch.float32, torch.float32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv(key, value, kc, vc, slots)
    write_kv_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_slot_minus_one_writes_nothing():
    key, value, kc, vc, slots = _case(8, 2, 64, 2, 16, torch.float32, torch.float32, pad_every=0)
    slots[:] = -1
    write_kv(key, value, kc, vc, slots)
    assert (kc == 7.0).all() and (vc == -7.0).all()


def test_casts_to_cache_dtype_and_strided_inputs():
    # K and V as views into a fused [T, Hq + 2 Hkv, D] projection output, float32 -> bf16 cache
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(9, 4 + 2 * 2, 64, generator=gen).to(DEVICE)
    key, value = fused[:, 4:6], fused[:, 6:8]
    _, _, kc, vc, slots = _case(9, 2, 64, 3, 16, torch.float32, torch.bfloat16)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv(key, value, kc, vc, slots)
    write_kv_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_high_slots():
    # slots in the last blocks of a 4k-block cache
    key, value, kc, vc, _ = _case(5, 1, 64, 4096, 16, torch.float16, torch.float16, pad_every=0)
    slots = torch.tensor([4096 * 16 - 1, 4095 * 16, 4000 * 16 + 3, -1, 17], device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv(key, value, kc, vc, slots)
    write_kv_ref(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_empty_batch():
    key, value, kc, vc, slots = _case(0, 2, 64, 2, 16, torch.float32, torch.float32, pad_every=0)
    write_kv(key, value, kc, vc, slots)
    assert (kc == 7.0).all()


def _args():
    return _case(4, 2, 64, 2, 16, torch.float32, torch.float32)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda k, v, kc, vc, s: (k[0], v, kc, vc, s), "key must be"),
        (lambda k, v, kc, vc, s: (k, v[:2], kc, vc, s), "value shape"),
        (lambda k, v, kc, vc, s: (k, v, kc[0], vc, s), "key_cache must be"),
        (lambda k, v, kc, vc, s: (k, v, kc, vc[:1], s), "value_cache shape"),
        (lambda k, v, kc, vc, s: (k, v, kc[:, :, :1], vc[:, :, :1], s), "key_cache heads"),
        (lambda k, v, kc, vc, s: (k, v, kc, vc, s.int()), "slot_mapping must be int64"),
        (lambda k, v, kc, vc, s: (k, v, kc, vc, s[:2]), "slot_mapping must be"),
        (lambda k, v, kc, vc, s: (k.int(), v, kc, vc, s), "key dtype"),
        (lambda k, v, kc, vc, s: (k, v, kc.double(), vc.double(), s), "key_cache dtype"),
        (
            lambda k, v, kc, vc, s: (k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, vc, s),
            "key must be contiguous in head_dim",
        ),
    ],
)
def test_wrapper_errors(mutate, match):
    with pytest.raises(ValueError, match=match):
        write_kv(*mutate(*_args()))
