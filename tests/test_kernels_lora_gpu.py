"""LoRA shrink/expand at real shapes on a CUDA GPU (`pytest -m gpu tests/test_kernels_lora_gpu.py`).

Not run in CI (no GPU there). Rank 16 (and 64, and a rank that is not a power of two padded in a
stack of rank 16), hidden 2048 and 4096 with the Llama projections' output sizes, 1 to 512
tokens in decode rows and prefill runs, 8 slots, tokens without an adapter; bf16 against the
float32 reference on the same rounded inputs. The output rows of tokens without an adapter are
compared bit for bit, and every output starts NaN-free only where the kernel writes.
"""

from __future__ import annotations

import pytest
import torch
from hf_paged.kernels import (
    lora_expand,
    lora_expand_ref,
    lora_segments,
    lora_shrink,
    lora_shrink_ref,
)
from hf_paged.kernels.kv_write import interpreting

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUM_SLOTS = 8
# bf16 inputs, float32 sums: the kernel rounds h = x @ A^T to bf16 once (as peft), then adds
# delta to y in float32 and rounds once; the reference rounds h the same way but delta and the
# sum each to bf16. |y| ~ 1, |delta| ~ 1: 2 bf16 ulp at 2 (7.8e-3 each) plus h's rounding
# carried through B.
ATOL, RTOL = 5e-2, 2e-2


def _slots(num_tokens: int, pattern: str, g: torch.Generator) -> torch.Tensor:
    if pattern == "decode":  # one token per request, adapters uniform, a quarter on the base
        s = torch.randint(-2, NUM_SLOTS, (num_tokens,), generator=g, device="cuda")
        return s.clamp(min=-1).to(torch.int32)
    # prefill: runs of one slot each (chunks of requests), a base run in the middle
    runs = torch.arange(num_tokens, device="cuda") * 5 // max(num_tokens, 1)
    s = torch.tensor([3, 0, -1, 7, 3], device="cuda")[runs]
    return s.to(torch.int32)


def _stack(num_slots, rows, cols, g, dtype, pad_from=None, rank_axis=1):
    w = torch.randn(num_slots, rows, cols, generator=g, device="cuda") / cols**0.5
    if pad_from is not None:  # a smaller rank zero-padded in the stack (A: rows, B: columns)
        w.narrow(rank_axis, pad_from, w.shape[rank_axis] - pad_from).zero_()
    return w.to(dtype)


def test_compiled_not_interpreted():
    assert not interpreting()


@pytest.mark.parametrize("hidden,out", [(2048, 2048), (2048, 5632), (4096, 1024), (4096, 14336)])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 64, 256, 512])
@pytest.mark.parametrize("pattern", ["decode", "prefill"])
def test_shrink_expand_real_shapes(hidden, out, num_tokens, pattern):
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    rank = 16
    a = _stack(NUM_SLOTS, rank, hidden, g, torch.bfloat16)
    b = _stack(NUM_SLOTS, out, rank, g, torch.bfloat16)
    scale = torch.rand(NUM_SLOTS, generator=g, device="cuda") + 0.5
    slots = _slots(num_tokens, pattern, g)
    x = torch.randn(num_tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
    y = torch.randn(num_tokens, out, generator=g, device="cuda").to(torch.bfloat16)
    sorted_tokens, slot_start = lora_segments(slots, NUM_SLOTS)
    s = lora_shrink(x, a, sorted_tokens, slot_start)
    got = y.clone()
    lora_expand(got, s, b, scale, sorted_tokens, slot_start)
    torch.cuda.synchronize()
    ref_s = lora_shrink_ref(x.float(), a.float(), slots)
    mine = slots >= 0
    torch.testing.assert_close(s.sum(0)[mine], ref_s[mine], atol=2e-2, rtol=2e-2)
    want = lora_expand_ref(y.float(), ref_s.to(torch.bfloat16).float(), b.float(), scale, slots)
    assert torch.equal(got[~mine], y[~mine])  # no adapter: untouched, bit for bit
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("rank,pad_from", [(64, None), (16, 12), (16, 1)])
def test_ranks(rank, pad_from):
    g = torch.Generator(device="cuda").manual_seed(rank)
    hidden, out, num_tokens = 4096, 4096, 100
    a = _stack(NUM_SLOTS, rank, hidden, g, torch.bfloat16, pad_from)
    b = _stack(NUM_SLOTS, out, rank, g, torch.bfloat16, pad_from, rank_axis=2)
    scale = torch.full((NUM_SLOTS,), 2.0, device="cuda")
    slots = _slots(num_tokens, "decode", g)
    x = torch.randn(num_tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
    y = torch.zeros(num_tokens, out, device="cuda", dtype=torch.bfloat16)
    seg = lora_segments(slots, NUM_SLOTS)
    got = y.clone()
    lora_expand(got, lora_shrink(x, a, *seg), b, scale, *seg)
    ref_s = lora_shrink_ref(x.float(), a.float(), slots).to(torch.bfloat16).float()
    want = lora_expand_ref(y.float(), ref_s, b.float(), scale, slots)
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)


def test_float32_matches_the_reference_closely():
    # no tf32 in float32: the kernels use IEEE dots there (peft's float32 arithmetic)
    g = torch.Generator(device="cuda").manual_seed(7)
    a = _stack(NUM_SLOTS, 16, 2048, g, torch.float32)
    b = _stack(NUM_SLOTS, 2048, 16, g, torch.float32)
    scale = torch.ones(NUM_SLOTS, device="cuda")
    slots = _slots(33, "decode", g)
    x = torch.randn(33, 2048, generator=g, device="cuda")
    y = torch.randn(33, 2048, generator=g, device="cuda")
    seg = lora_segments(slots, NUM_SLOTS)
    got = y.clone()
    lora_expand(got, lora_shrink(x, a, *seg), b, scale, *seg)
    want = lora_expand_ref(y, lora_shrink_ref(x, a, slots), b, scale, slots)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_capturable_in_a_cuda_graph():
    # static shapes and no host sync: the segments and both kernels replay from a graph, and a
    # refill of the slot buffer between replays changes which adapter each token gets
    g = torch.Generator(device="cuda").manual_seed(3)
    a = _stack(NUM_SLOTS, 16, 2048, g, torch.bfloat16)
    b = _stack(NUM_SLOTS, 2048, 16, g, torch.bfloat16)
    scale = torch.ones(NUM_SLOTS, device="cuda")
    x = torch.randn(16, 2048, generator=g, device="cuda").to(torch.bfloat16)
    y0 = torch.randn(16, 2048, generator=g, device="cuda").to(torch.bfloat16)
    slots = torch.full((16,), -1, dtype=torch.int32, device="cuda")
    y = y0.clone()

    def step():
        y.copy_(y0)
        seg = lora_segments(slots, NUM_SLOTS)
        lora_expand(y, lora_shrink(x, a, *seg, split_k=4), b, scale, *seg)

    step()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for pattern in ("decode", "prefill"):
        slots.copy_(_slots(16, pattern, g))
        graph.replay()
        torch.cuda.synchronize()
        want = y0.clone()
        seg = lora_segments(slots, NUM_SLOTS)
        lora_expand(want, lora_shrink(x, a, *seg, split_k=4), b, scale, *seg)
        assert torch.equal(y, want)


def _variants(jit_fn) -> int:
    return sum(len(cache[0]) for cache in jit_fn.device_caches.values())


def test_no_new_variant_per_token_count():
    """Token counts 1 to 8192 compile at most one shrink and one expand variant per token tile
    size (16 up to 256 tokens, 64 beyond): the split follows the token count, and a variant per
    split used to compile (~1 s each) inside whichever prefill chunk met it first."""
    from hf_paged.kernels.lora import _lora_expand_kernel, _lora_shrink_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    a = _stack(NUM_SLOTS, 16, 2048, g, torch.bfloat16)
    b = _stack(NUM_SLOTS, 5632, 16, g, torch.bfloat16)
    scale = torch.ones(NUM_SLOTS, device="cuda")
    kernels = (_lora_shrink_kernel, _lora_expand_kernel)
    before = [_variants(k) for k in kernels]
    for t in (1, 7, 200, 256, 257, 300, 1000, 1100, 2048, 3000, 4097, 8192):
        slots = _slots(t, "prefill", g)
        segments = lora_segments(slots, NUM_SLOTS)
        x = torch.randn(t, 2048, generator=g, device="cuda").bfloat16()
        y = torch.zeros(t, 5632, device="cuda").bfloat16()
        lora_expand(y, lora_shrink(x, a, *segments), b, scale, *segments)
    torch.cuda.synchronize()
    added = [_variants(k) - n for k, n in zip(kernels, before)]
    assert max(added) <= 2, added  # one per tile size (t <= 256: 16 rows, more: 64)
