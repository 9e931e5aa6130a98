"""FP8 KV cache end to end (kv_cache_dtype="fp8_e4m3"/"fp8_e5m2"): greedy output identical to
transformers' generate whose attention sees K/V rounded as the cache stores them
(hf_paged/quantization/kv_reference.py), through prefix caching, preemption and forks; the
KV budget holds more tokens; bad options refused."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.quantization.kv_cache import FP8_KV_CACHE_DTYPES, HEADROOM
from hf_paged.quantization.kv_reference import fake_quantized_kv

LENGTHS = [1, 7, 16, 33, 64, 90]


def paged_and_reference(model, ids, mask, options, **gen):
    """(engine output, its kv scales, transformers' output over the same FP8-rounded K/V)."""
    hf_paged.patch(model, **options)
    try:
        engine = hf_paged.get_engine(model)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen)
        engine.check_invariants()
        scales, dtype = engine.runner.kv_scales, engine.runner.kv_spec.dtype
        stats = engine.stats()
    finally:
        hf_paged.unpatch(model)
    with fake_quantized_kv(model, dtype, scales):
        ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **gen)
    return out, ref, scales, stats


@pytest.mark.parametrize("kv", list(FP8_KV_CACHE_DTYPES))
@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3", "gpt_neox"])
def test_greedy_parity_against_fp8_rounded_reference(arch, kv, tiny_model, batch_factory):
    model = tiny_model(arch)
    ids, mask = batch_factory(LENGTHS)
    out, ref, scales, _ = paged_and_reference(
        model, ids, mask, {"kv_cache_dtype": kv}, max_new_tokens=24
    )
    assert torch.equal(out, ref)
    assert len(scales) == model.config.num_hidden_layers
    heads = model.config.num_key_value_heads
    for pair in scales:  # calibrated: one scale per KV head
        for s in pair:
            assert s.shape == (heads,) and bool(((s > 0) & s.isfinite()).all())
    # the rounding is real: plain transformers differs somewhere for e5m2's 2-bit mantissa
    if kv == "fp8_e5m2" and arch == "llama":
        plain = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24
        )
        assert not torch.equal(plain, out)


def test_calibrated_scales_cover_the_calibration_activations(tiny_model):
    # the largest |K| seen maps to 1 / HEADROOM of the format's range
    from hf_paged.kernels.kv_write import FP8_MAX

    from hf_paged.quantization.kv_cache import _calibrate

    model = tiny_model("llama")
    eng = hf_paged.Engine(model, kv_cache_dtype="fp8_e4m3")
    try:
        scales = eng.runner.kv_scales
    finally:
        eng.shutdown()
    amax = _calibrate(model)
    fmax = FP8_MAX[torch.float8_e4m3fn]
    for layer, (k_scale, v_scale) in enumerate(scales):
        torch.testing.assert_close(k_scale, HEADROOM * amax[layer][0] / fmax)
        torch.testing.assert_close(v_scale, HEADROOM * amax[layer][1] / fmax)
    assert amax[0][0].shape == (model.config.num_key_value_heads,)  # per KV head


def test_per_head_scales_follow_each_head(tiny_model, batch_factory):
    # one KV head's keys 1000x smaller than the others': its scale follows it (a per-layer
    # scale would put them near the subnormals), and the output still equals the reference
    model = tiny_model("llama")
    attn = model.model.layers[1].self_attn
    head_dim = attn.head_dim
    with torch.no_grad():
        attn.k_proj.weight[:head_dim] *= 1e-3
    ids, mask = batch_factory([6, 25])
    out, ref, scales, _ = paged_and_reference(
        model, ids, mask, {"kv_cache_dtype": "fp8_e4m3"}, max_new_tokens=10
    )
    assert torch.equal(out, ref)
    k_scale = scales[1][0]
    assert 300 < float(k_scale[1:].min() / k_scale[0]) < 3000


def test_given_scale_used_for_every_layer(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([5, 20])
    options = {"kv_cache_dtype": "fp8_e4m3", "kv_cache_scale": 0.05}
    out, ref, scales, _ = paged_and_reference(model, ids, mask, options, max_new_tokens=12)
    assert scales == [(0.05, 0.05)] * model.config.num_hidden_layers
    assert torch.equal(out, ref)


def test_triton_kernels_fp8_parity(tiny_model, batch_factory):
    # the Triton write/attention kernels (interpreted on CPU) over an FP8 cache
    model = tiny_model("llama")
    ids, mask = batch_factory([3, 18])
    options = {"kv_cache_dtype": "fp8_e4m3", "attention_backend": "triton"}
    out, ref, _, _ = paged_and_reference(model, ids, mask, options, max_new_tokens=6)
    assert torch.equal(out, ref)


def test_prefix_caching_and_preemption_unchanged(tiny_model, batch_factory):
    # a shared prefix (cache hits) and a cache too small for every sequence (preemption)
    model = tiny_model("llama")
    ids, mask = batch_factory([40, 40, 40, 12], seed=3)
    ids[1:3, 8:40] = ids[0, 8:40]  # same first 32 prompt tokens (left-padded to 40)
    options = {"kv_cache_dtype": "fp8_e4m3", "num_blocks": 12, "block_size": 8}
    out, ref, _, stats = paged_and_reference(model, ids, mask, options, max_new_tokens=30)
    assert torch.equal(out, ref)
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0


def test_forked_blocks_copied_bytewise(tiny_model):
    model = tiny_model("llama")
    eng = hf_paged.Engine(model, kv_cache_dtype="fp8_e5m2", num_blocks=8)
    try:
        k_cache, v_cache = eng.runner.kv_caches[0]
        k_cache[2] = torch.randn(k_cache.shape[1:]).to(k_cache.dtype)
        v_cache[2] = torch.randn(v_cache.shape[1:]).to(v_cache.dtype)
        eng.runner.copy_blocks([(2, 5)])
        assert torch.equal(k_cache[5].view(torch.uint8), k_cache[2].view(torch.uint8))
        assert torch.equal(v_cache[5].view(torch.uint8), v_cache[2].view(torch.uint8))
    finally:
        eng.shutdown()


def test_kv_budget_holds_more_tokens(tiny_model):
    from hf_paged.worker.startup import KVCacheSpec

    model = tiny_model("llama")
    budget = {"cpu_kv_cache_bytes": 64 * 1024}
    sizes = {}
    for kv in ("auto", "fp8_e4m3"):
        eng = hf_paged.Engine(model, kv_cache_dtype=kv, **budget)
        sizes[kv] = eng.runner.num_blocks
        assert eng.runner.kv_caches[0][0].element_size() == (4 if kv == "auto" else 1)
        eng.shutdown()
    assert sizes["fp8_e4m3"] == 4 * sizes["auto"]  # float32 model: 4 bytes -> 1
    bf16 = KVCacheSpec(model, 16, torch.bfloat16).bytes_per_block
    fp8 = KVCacheSpec(model, 16, torch.float8_e4m3fn).bytes_per_block
    assert bf16 == 2 * fp8  # the usual case: twice the tokens at the same memory


@pytest.mark.parametrize(
    "options,match",
    [
        ({"kv_cache_dtype": "float8_e4m3fn"}, "kv_cache_dtype must be one of"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of"),
        ({"kv_cache_scale": 0.1}, "kv_cache_scale applies to an FP8 KV cache only"),
        ({"kv_cache_dtype": "fp8_e4m3", "kv_cache_scale": -1.0}, "kv_cache_scale must be"),
        ({"kv_cache_dtype": "fp8_e4m3", "kv_cache_scale": float("nan")}, "kv_cache_scale must"),
        ({"kv_cache_dtype": "fp8_e4m3", "kv_cache_scale": "1"}, "kv_cache_scale must be"),
    ],
)
def test_bad_fp8_options_refused(options, match, tiny_model):
    with pytest.raises(ValueError, match=match):
        hf_paged.Engine(tiny_model("llama"), **options)


def test_small_batch_forward_off_with_fp8_cache(tiny_model):
    eng = hf_paged.Engine(
        tiny_model("llama"), kv_cache_dtype="fp8_e4m3", attention_backend="triton"
    )
    try:
        assert eng.runner.forward.small_batch is None
        assert "fp8_e4m3" in eng.runner.forward.small_batch_status
    finally:
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_kv_on_gpu_graphs_parity_and_twice_the_blocks(tiny_model, batch_factory):
    # Triton kernels compiled, CUDA graphs and compile on (the defaults), float32 compute for
    # exact parity; then a bf16 model: twice the blocks in the same gpu_memory_utilization
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in batch_factory(LENGTHS))
    out, ref, scales, _ = paged_and_reference(
        model, ids, mask, {"kv_cache_dtype": "fp8_e4m3"}, max_new_tokens=24
    )
    assert torch.equal(out, ref)
    assert scales[0][0].is_cuda and scales[0][0].shape == (model.config.num_key_value_heads,)
    bf16 = tiny_model("llama", dtype=torch.bfloat16).cuda()
    blocks = {}
    for kv in ("auto", "fp8_e4m3"):
        eng = hf_paged.Engine(bf16, kv_cache_dtype=kv, gpu_memory_utilization=0.3, compile=False)
        blocks[kv] = eng.runner.num_blocks
        eng.shutdown()
    assert 1.95 <= blocks["fp8_e4m3"] / blocks["auto"] <= 2.05, blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_head_scales_equals_attention_over_rounded_kv(dtype):
    # grouped-query attention (4 query heads per KV head) over per-head FP8-rounded K/V
    # against the same attention with the scales folded into queries and outputs
    from hf_paged.kernels.kv_write import quantize_ref

    from hf_paged.quantization.kv_cache import fold_head_scales
    from hf_paged.quantization.kv_reference import round_like_cache

    gen = torch.Generator().manual_seed(0)
    t, hkv, group, d = 12, 2, 4, 16
    q = torch.randn(t, hkv * group, d, generator=gen).to(dtype)
    k = (torch.randn(t, hkv, d, generator=gen) * torch.tensor([0.01, 3.0])[:, None]).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    k_scale, v_scale = torch.tensor([0.01, 3.0]) * 4 / 448, torch.tensor([0.02, 0.05])
    fp8 = torch.float8_e4m3fn

    def attend(q, k, v):  # [T, H, D] in float32, causal, K/V repeated per query group
        k, v = (x.float().repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), k, v, is_causal=True
        )
        return out.transpose(0, 1)

    # the reference rounds [batch, heads, tokens, dim]: the transformers layout
    k_hat, v_hat = (
        round_like_cache(x.transpose(0, 1)[None], fp8, s)[0].transpose(0, 1)
        for x, s in ((k, k_scale), (v, v_scale))
    )
    ref = attend(q, k_hat, v_hat)
    q2, k2, v2, out_scale = fold_head_scales(q, k, v, k_scale, v_scale)
    k8, v8 = (quantize_ref(x, fp8, 1.0).float() for x in (k2, v2))
    got = attend(q2, k8, v8) * out_scale
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    # per head: the small head's keys use the format's range (under the layer's largest scale
    # they would sit near 1, among the subnormals' neighbours)
    assert float(k8[:, 0].abs().max()) > 50


def test_draft_model_over_fp8_caches(tiny_model):
    # speculative decoding: the draft's cache is FP8 too, with its own per-head scales; greedy
    # output as the FP8 engine's without a draft (verification steps write and read the same
    # rounded K/V as single-token steps)
    target, draft = tiny_model("llama"), tiny_model("llama", seed=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 23, 41)]
    params = hf_paged.SamplingParams(max_tokens=16, temperature=0)
    options = {"kv_cache_dtype": "fp8_e4m3"}
    outs = []
    spec = {"draft_model": draft, "speculative_policy": "fixed", "num_speculative_tokens": 3}
    for extra in ({}, spec):
        engine = hf_paged.Engine(target, **options, **extra)
        try:
            got = engine.generate(prompts, params, use_tqdm=False)
            engine.check_invariants()
            if extra:
                assert engine.stats()["spec_num_proposed"] > 0
        finally:
            engine.shutdown()
        outs.append([o.output_token_ids for o in got])
    assert outs[0] == outs[1]
