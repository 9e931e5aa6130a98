"""FP8 weights (quantization="fp8"): the FP8 GEMV kernel against its torch reference, the
per-channel quantisation, greedy output identical to transformers' generate of the same model
with its linear weights replaced by their dequantised FP8 values, fused projections, refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_paged.kernels.fp8_gemv import dequantize_weight, fp8_gemv, fp8_gemv_ref
from torch import nn

import hf_paged
from hf_paged.quantization.fp8_weights import (
    FP8_MAX,
    Fp8Linear,
    fp8_linear,
    quantize_weight,
)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def dequantised_copy(model: nn.Module) -> nn.Module:
    """The model with every linear weight but lm_head rounded through FP8 (1x128 block scales)."""
    ref = copy.deepcopy(model)
    skip = ref.get_output_embeddings()
    with torch.no_grad():
        for module in ref.modules():
            if type(module) is nn.Linear and module is not skip:
                w8, scale = quantize_weight(module.weight)
                module.weight.copy_(dequantize_weight(w8, scale))
    return ref


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_matches_reference(rows, dtype, bias):
    gen = torch.Generator().manual_seed(0)
    # N, K not tile multiples; the second scale block twice the first's magnitude
    w = torch.randn(40, 200, generator=gen) * torch.where(torch.arange(200) < 128, 1.0, 2.0)
    w8, scale = quantize_weight(w)
    x = torch.randn(rows, 200, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype) if bias else None
    args = [t.to(DEVICE) if t is not None else None for t in (x, w8, scale, b)]
    got = fp8_gemv(*args)
    ref = fp8_gemv_ref(x.float(), w8, scale, None if b is None else b.float())
    if rows == 3:  # the kernel reads the scales by their strides: a row-major copy agrees
        row_major = args[2].contiguous()
        assert row_major.stride() != args[2].stride()
        torch.testing.assert_close(fp8_gemv(args[0], args[1], row_major, args[3]), got)
    assert got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("k", [200, 640])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_gemv_split_k_adds_partials_in_order(k, dtype):
    # K split over programs (2 and 3 ranges of 128-column blocks, one range shorter) whose
    # float32 partial sums a second launch adds; bf16 rows multiply in fp16 (dot_fp16), a bf16
    # row beyond fp16's range saturates at 65504 there
    gen = torch.Generator().manual_seed(1)
    w8, scale = quantize_weight(torch.randn(48, k, generator=gen))
    x = torch.randn(5, k, generator=gen)
    b = torch.randn(48, generator=gen)
    args = (x.to(dtype).to(DEVICE), w8.to(DEVICE), scale.to(DEVICE), b.to(dtype).to(DEVICE))
    ref = fp8_gemv_ref(x.to(dtype).float(), w8, scale, b.to(dtype).float())
    whole = fp8_gemv(*args, config=dict(BLOCK_N=16, splits=1, num_warps=4, num_stages=2))
    for splits in (2, 3):
        cfg = dict(BLOCK_N=16, splits=splits, num_warps=4, num_stages=2)
        got = fp8_gemv(*args, config=cfg)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float().cpu(), ref, atol=0.1, rtol=2e-2)
        torch.testing.assert_close(got, whole, atol=0.1, rtol=2e-2)
        assert torch.equal(got, fp8_gemv(*args, config=cfg))  # the same on every run
    if dtype == torch.bfloat16:
        big = args[0].clone()
        big[0, 0] = 1e6  # fp16's largest is 65504
        got = fp8_gemv(big, *args[1:3], config=dict(BLOCK_N=16, splits=2, num_warps=4))
        sat = big.float().clamp(-65504, 65504)
        expected = fp8_gemv_ref(sat.cpu(), w8, scale)
        torch.testing.assert_close(got.float().cpu()[0], expected[0], atol=0.5, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantisation_kernel_matches_torch(dtype):
    # kernels/fp8_quant.py: per row and 128 columns, float8_e4m3fn and M-major scales, padded
    # rows zero. The interpreter's float8 cast truncates, and just below a power of 2 it lands
    # a binade low (1.9989 -> 1.0, where a GPU rounds to 2.0): values may differ up to that
    # here; the GPU test asks for equality
    from hf_paged.kernels.fp8_quant import quantize_rows, quantize_rows_ref

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 384, generator=g) * torch.linspace(0.01, 30, 384)).to(dtype)
    q, s = quantize_rows(x.to(DEVICE), 16)
    q_ref, s_ref = quantize_rows_ref(x, 16)
    assert q.shape == (16, 384) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (16, 3) and s.stride() == (1, 16)  # M-major, as cuBLASLt reads it
    torch.testing.assert_close(s.cpu(), s_ref, atol=0, rtol=1e-6)
    a, b = q.cpu().float(), q_ref.float()
    assert ((a - b).abs() <= b.abs() / 2 + 2**-9).all()
    assert (a == b).float().mean() > 0.8
    assert (a[5:] == 0).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_rows(x[:, :100].contiguous())


def test_fp8_gemv_refuses_bad_input():
    w8, scale = quantize_weight(torch.randn(8, 32))
    with pytest.raises(ValueError, match="rows"):
        fp8_gemv(torch.randn(17, 32), w8, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv(torch.randn(1, 32), w8.float(), scale)
    with pytest.raises(ValueError, match="weight"):
        fp8_gemv(torch.randn(1, 16), w8, scale)
    with pytest.raises(ValueError, match="scale must be"):  # one scale per row: the old layout
        fp8_gemv(torch.randn(1, 32), w8, scale[:, 0])


def test_quantize_weight_per_block_of_128_columns():
    # rows and 128-column blocks of very different magnitudes; K=300: a partial last block
    w = torch.randn(6, 300) * torch.tensor([1e-3, 0.1, 1, 10, 100, 1e4])[:, None]
    w = w * torch.tensor([1.0, 1e-3, 50.0]).repeat_interleave(128)[:300]
    w8, scale = quantize_weight(w)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == w.shape and w8.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (6, 3)
    assert scale.stride() == (1, 6)  # N-major, as the blockwise scaled_mm reads it
    expected = torch.stack([w[:, i : i + 128].abs().amax(1) for i in (0, 128, 256)], 1) / FP8_MAX
    torch.testing.assert_close(scale, expected)
    back = dequantize_weight(w8, scale)
    # each block's largest weight is exact; e4m3 keeps 3 mantissa bits: within 2^-4 relative
    # (normal range), each block at its own scale
    per_col = scale.repeat_interleave(128, 1)[:, :300]
    assert torch.all((back - w).abs() <= 2.0**-4 * w.abs() + 2.0**-9 * per_col * 2**6)
    for i in (0, 128, 256):
        blk = w[:, i : i + 128]
        top = blk.abs().argmax(1, keepdim=True)
        torch.testing.assert_close(back[:, i : i + 128].gather(1, top), blk.gather(1, top))


def test_fp8_linear_cpu_is_weight_only_dequantised_matmul():
    lin = nn.Linear(24, 10, bias=True)
    q = Fp8Linear(lin)
    x = torch.randn(2, 5, 24)
    expected = nn.functional.linear(x, dequantize_weight(q.weight, q.weight_scale), lin.bias)
    torch.testing.assert_close(q(x), expected, atol=1e-5, rtol=1e-5)
    assert q.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gpt_neox"])
def test_greedy_parity_against_dequantised_model(arch, tiny_model, batch_factory):
    model = tiny_model(arch)
    ref_model = dequantised_copy(model)
    ids, mask = batch_factory([1, 7, 33, 64])
    ref = ref_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    hf_paged.patch(model, quantization="fp8")
    try:
        engine = hf_paged.get_engine(model)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
        engine.check_invariants()
        fused = engine.num_fused_projections
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)
    if arch in ("llama", "qwen2"):
        assert fused > 0  # q/k/v and gate/up quantised as their fused matrices
    # the model keeps FP8 layers after the engine, and its own generate still agrees
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears == [model.get_output_embeddings()]
    again = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    assert torch.equal(again, ref)


def test_fp8_weights_with_fp8_kv_cache(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([5, 30])
    hf_paged.patch(model, quantization="fp8", kv_cache_dtype="fp8_e4m3")
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
        hf_paged.get_engine(model).check_invariants()
    finally:
        hf_paged.unpatch(model)
    assert out.shape == (2, 38)
    # a second engine on the already quantised model: nothing quantised twice
    hf_paged.patch(model, quantization="fp8")
    try:
        again = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8
        )
    finally:
        hf_paged.unpatch(model)
    assert again.shape == out.shape


def test_fused_projection_slices_quantised(tiny_model):
    from hf_paged.integrations.fused_projections import fuse_projections

    from hf_paged.quantization.fp8_weights import quantize_model

    model = tiny_model("llama")
    ref = dequantised_copy(model)
    fuse_projections(model)
    quantize_model(model, "fp8")
    attn, ref_attn = model.model.layers[0].self_attn, ref.model.layers[0].self_attn
    x = torch.randn(1, 3, 64)
    # out of the group's call order: each slice from its own rows and scales
    for name in ("v_proj", "k_proj", "q_proj"):
        got = getattr(attn, name)(x)
        torch.testing.assert_close(got, getattr(ref_attn, name)(x), atol=1e-5, rtol=1e-5)


def fp8_checkpoint(model: nn.Module, block, ue8m0: bool = False) -> nn.Module:
    """The model as transformers loads a FineGrainedFP8 checkpoint: each linear but lm_head a
    transformers FP8Linear holding float8 weights and one scale per [block_n, block_k] block
    (None: one per tensor; ue8m0: scales stored as powers of two, float8_e8m0fnu)."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    skip = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, lin in list(parent.named_children()):
            if type(lin) is not nn.Linear or lin is skip:
                continue
            n, k = lin.weight.shape
            bn, bk = block or (n, k)
            w = lin.weight.detach().float()
            tiles = w.view(n // bn, bn, k // bk, bk)
            scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
            if ue8m0:
                scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
            w8 = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            layer = FP8Linear(k, n, block_size=block, has_bias=lin.bias is not None)
            layer.weight = nn.Parameter(w8.view(n, k), requires_grad=False)
            stored = scale.to(torch.float8_e8m0fnu) if ue8m0 else scale
            layer.weight_scale_inv = nn.Parameter(
                stored if block else stored.reshape(()), requires_grad=False
            )
            if lin.bias is not None:
                layer.bias = lin.bias
            setattr(parent, name, layer)
    return model


def dequantised_checkpoint(model: nn.Module) -> nn.Module:
    """A copy whose FP8Linear layers are nn.Linear with weight = codes x their block's scale."""
    ref = copy.deepcopy(model)
    for parent in list(ref.modules()):
        for name, layer in list(parent.named_children()):
            if type(layer).__name__ != "FP8Linear":
                continue
            n, k = layer.weight.shape
            if layer.weight.dtype != torch.float8_e4m3fn:  # left unquantised by transformers
                lin = nn.Linear(k, n, bias=layer.bias is not None)
                lin.weight, lin.bias = layer.weight, layer.bias
                setattr(parent, name, lin)
                continue
            s = layer.weight_scale_inv.float().reshape(
                (1, 1) if layer.block_size is None else layer.weight_scale_inv.shape
            )
            w = layer.weight.float() * s.repeat_interleave(n // s.shape[0], 0).repeat_interleave(
                k // s.shape[1], 1
            )
            lin = nn.Linear(k, n, bias=layer.bias is not None)
            lin.weight = nn.Parameter(w)
            if layer.bias is not None:
                lin.bias = layer.bias
            setattr(parent, name, lin)
    return ref


@pytest.mark.parametrize(
    "block,ue8m0", [((128, 128), False), ((64, 256), False), ((128, 128), True), (None, False)]
)
def test_fp8_checkpoint_runs_on_engine_kernels(block, ue8m0, tiny_model, batch_factory):
    # transformers' FP8Linear layers (FineGrainedFP8 checkpoints) stand behind Fp8Linear views of
    # the same weight bytes while patched: greedy output identical to transformers' generate on
    # the dequantised weights (CPU: weight-only products), q/k/v and gate/up fused as FP8, and
    # unpatch puts the same layer objects back with the same weights
    from hf_paged.quantization.fp8_checkpoints import row_block_scales

    model = fp8_checkpoint(
        tiny_model("llama", hidden_size=256, intermediate_size=512), block, ue8m0
    )
    ref_model = dequantised_checkpoint(model)
    layers = {n: m for n, m in model.named_modules() if type(m).__name__ == "FP8Linear"}
    weights = {n: m.weight.clone() for n, m in layers.items()}
    one = next(iter(layers.values()))
    expected = dequantize_weight(one.weight, row_block_scales(one))
    torch.testing.assert_close(expected, ref_model.get_submodule(next(iter(layers))).weight)
    ids, mask = batch_factory([1, 7, 33])
    ref = ref_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    hf_paged.patch(model)
    try:
        engine = hf_paged.get_engine(model)
        assert not any(type(m).__name__ == "FP8Linear" for m in model.modules())
        assert engine.num_fused_projections > 0
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
        engine.check_invariants()
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)
    after = {n: m for n, m in model.named_modules() if type(m).__name__ == "FP8Linear"}
    assert after.keys() == layers.keys() and all(after[n] is layers[n] for n in layers)
    assert all(
        torch.equal(after[n].weight.view(torch.uint8), weights[n].view(torch.uint8)) for n in after
    )


def test_fp8_checkpoint_layouts_without_an_exact_form_stay_as_loaded():
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from hf_paged.quantization.fp8_checkpoints import row_block_scales

    narrow = FP8Linear(256, 128, block_size=(128, 64))  # 64-column blocks: finer than 128
    assert row_block_scales(narrow) is None
    unquantised = FP8Linear(256, 128, block_size=(128, 128))
    unquantised.weight = nn.Parameter(torch.randn(128, 256), requires_grad=False)
    assert row_block_scales(unquantised) is None


@pytest.mark.parametrize(
    "value,match", [("int4", "quantization must be None or 'fp8'"), (True, "quantization must")]
)
def test_bad_quantization_option(value, match, tiny_model):
    with pytest.raises(ValueError, match=match):
        hf_paged.Engine(tiny_model("llama"), quantization=value)


def test_already_quantised_model_refused(tiny_model):
    model = tiny_model("llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes"}

    class Q:
        quant_method = "bitsandbytes"

    model.config.quantization_config = Q()
    with pytest.raises(ValueError, match="already quantised"):
        hf_paged.Engine(model, quantization="fp8")
    assert all(type(m) is not Fp8Linear for m in model.modules())  # untouched


def test_peft_model_refused(peft_model):
    with pytest.raises(ValueError, match="quantization=.fp8. on a PeftModel"):
        hf_paged.Engine(peft_model(), quantization="fp8")


def test_start_up_check_runs_fp8_products_weight_only(tiny_model, monkeypatch):
    # the blockwise op reads weight_only() when it runs (it is opaque to torch.compile): inside
    # it, the weight-only product; and the start-up check holds it around both forwards
    from hf_paged.engine import verify
    from hf_paged.quantization import fp8_weights

    x = torch.randn(20, 256)
    w8, scale = quantize_weight(torch.randn(64, 256))
    import threading

    seen_elsewhere = []
    with fp8_weights.weight_only():
        got = torch.ops.hf_paged.fp8_scaled_mm(x, w8, scale, None)
        other = threading.Thread(
            target=lambda: seen_elsewhere.append(fp8_weights.weight_only_held())
        )
        other.start()
        other.join()
    assert torch.equal(got, fp8_gemv_ref(x, w8, scale))
    assert seen_elsewhere == [False]  # engines stepping in other threads keep their products
    assert not fp8_weights.weight_only_held()
    held = []
    real_ref, real_paged = verify._reference_logits, verify._paged_logits
    monkeypatch.setattr(
        verify,
        "_reference_logits",
        lambda *a: held.append(fp8_weights.weight_only_held()) or real_ref(*a),
    )
    monkeypatch.setattr(
        verify,
        "_paged_logits",
        lambda *a: held.append(fp8_weights.weight_only_held()) or real_paged(*a),
    )
    engine = hf_paged.Engine(tiny_model("llama"), quantization="fp8")
    engine.shutdown()
    assert held == [True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4, 16, 17, 64, 100, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_fp8_linear_real_shapes_gpu(rows, n, k):
    # Llama-3-8B's fused qkv, o, gate/up and down shapes: the GEMV (<= 16 rows) and the
    # blockwise scaled_mm with 1x128 activation scales (more rows) against the weight-only
    # product; weights whose 128-column blocks differ in magnitude, so a wrong block's scale shows
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale_blocks = torch.rand(k // 128, device="cuda", generator=gen) * 4 + 0.25
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    w8, scale = quantize_weight(w * scale_blocks.repeat_interleave(128))
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    got = fp8_linear(x, w8, scale).float()
    ref = fp8_gemv_ref(x.float(), w8, scale)
    rel = (got - ref).norm() / ref.norm()
    # GEMV: bf16 output rounding only; scaled_mm adds e4m3 activation rounding (~2^-4 / sqrt)
    assert rel < (5e-3 if rows <= 16 else 3e-2), rel


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_blockwise_scaled_mm_taken_on_hopper_gpu():
    # the FP8 tensor-core path is the one large batches take on an H200 (not the fallback)
    from hf_paged.quantization.fp8_weights import _blockwise_scaled_mm_ok

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("blockwise scaled_mm is a Hopper path")
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w8, _ = quantize_weight(torch.randn(4096, 4096, device="cuda"))
    assert _blockwise_scaled_mm_ok(x, w8), torch.version.cuda


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_finegrained_fp8_checkpoint_runs_on_engine_kernels_gpu(tiny_model, batch_factory, tmp_path):
    # transformers' own FP8 checkpoints (FineGrainedFP8Config; it needs a GPU to load them, and
    # hub kernels to run them): the engine runs them on its FP8 kernels, float32 activations
    # (weight-only products at every row count), greedy output as transformers' generate on the
    # dequantised weights; unpatch gives transformers' layers back
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    tiny_model("llama", hidden_size=256, intermediate_size=512).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=FineGrainedFP8Config(), device_map="cuda"
    )
    layers = [m for m in model.modules() if type(m).__name__ == "FP8Linear"]
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    ref_model = dequantised_checkpoint(model)
    ids, mask = (t.cuda() for t in batch_factory([3, 12, 30]))
    ref = ref_model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    with pytest.raises(ValueError, match="already quantised"):
        hf_paged.Engine(model, quantization="fp8")
    hf_paged.patch(model)
    try:
        assert not any(type(m).__name__ == "FP8Linear" for m in model.modules())
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
        hf_paged.get_engine(model).check_invariants()
    finally:
        hf_paged.unpatch(model)
    assert [m for m in model.modules() if type(m).__name__ == "FP8Linear"] == layers
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_fp8_engine_compiles_llama_3_8b_layers_gpu():
    # two decoder layers of Llama-3-8B's shape under the engine's defaults (torch.compile of each
    # layer, CUDA graphs, mixed steps): inductor once crashed compiling the traced activation
    # quantisation of the blockwise scaled_mm; greedy tokens as the same engine without compile
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=2048, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    prompts = [[(7 * i + j) % 2000 + 3 for j in range(n)] for i, n in enumerate((5, 40, 300))]
    params = hf_paged.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for compile_ in (True, False):
        engine = hf_paged.Engine(model, quantization="fp8", compile=compile_, max_num_seqs=8)
        try:
            outs[compile_] = [o.output_token_ids for o in engine.generate(prompts, params)]
            engine.check_invariants()
        finally:
            engine.shutdown()
    assert all(len(o) == 12 for o in outs[True])
    same = sum(a == b for x, y in zip(outs[True], outs[False]) for a, b in zip(x, y))
    assert same >= 30, outs  # bf16: a near-tie may round apart late in a sequence


def test_small_batch_forward_runs_fp8_weights(tiny_model):
    # steps of a few tokens take the fused small-batch forward on FP8 layers too (its GEMVs
    # dequantise each 128-column block in registers): the same greedy tokens and log-probs as
    # transformers' forward over the same FP8 layers (Triton interpreter on the CPU)
    model = tiny_model("llama")
    other = copy.deepcopy(model)  # an engine fuses q/k/v and gate/up before quantising them
    opts = dict(quantization="fp8", attention_backend="triton", async_scheduling=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 30, 9)]
    params = hf_paged.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    plain = hf_paged.Engine(model, small_batch_rows=0, **opts)
    want = plain.generate(prompts, params)
    plain.shutdown()
    eng = hf_paged.Engine(other, small_batch_rows=8, **opts)
    fast = eng.runner.forward.small_batch
    assert fast is not None, eng.runner.forward.small_batch_status
    seen = []
    real = fast.__call__
    eng.runner.forward.small_batch = type(
        "Counting",
        (),
        {"max_rows": fast.max_rows, "__call__": lambda s, *a: seen.append(1) or real(*a)},
    )()
    try:
        got = eng.generate(prompts, params)
        eng.check_invariants()
    finally:
        eng.shutdown()
    assert seen  # the 3-row decodes ran fused
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    for a, b in zip(got, want):
        for da, db in zip(a.logprobs, b.logprobs):
            assert da.keys() == db.keys()
            assert all(da[t] == pytest.approx(db[t], abs=1e-4) for t in da)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(
    "n,k,gated", [(6144, 4096, False), (14336, 4096, True), (4096, 14336, False)]
)
def test_fused_gemv_fp8_real_shapes_gpu(rows, n, k, gated):
    # the small-batch forward's GEMVs on Llama-3-8B's FP8 q/k/v, gate/up and down matrices
    # (bf16 activations) against the dequantised product; blocks of different magnitude
    from hf_paged.kernels import fused_gemv, fused_gemv_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = torch.rand(k // 128, device="cuda", generator=gen) * 4 + 0.25
    w = torch.randn(2 * n if gated else n, k, device="cuda", generator=gen) * 0.02
    w8, scale = quantize_weight(w * blocks.repeat_interleave(128))
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    kw = dict(weight_scale=scale[:n])
    if gated:
        kw.update(up_weight=w8[n:], up_scale=scale[n:])
    for pdl in (False, True):
        got = fused_gemv(x, w8[:n], pdl=pdl, **kw).float()
        ref = fused_gemv_ref(x.float(), w8[:n], **kw)
        rel = (got - ref).norm() / ref.norm()
        assert rel < 1e-2, (pdl, rel)  # bf16 output (and, gated, the activation's) rounding


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,k", [(1, 4096), (17, 4096), (256, 4096), (300, 14336)])
def test_activation_quantisation_kernel_real_shapes_gpu(rows, k):
    from hf_paged.kernels.fp8_quant import quantize_rows, quantize_rows_ref

    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16) * 3
    p = rows + (-rows % 16)
    q, s = quantize_rows(x, p)
    q_ref, s_ref = quantize_rows_ref(x, p)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=1e-6)
    same = (q.float() == q_ref.float()).float().mean().item()
    assert same > 0.999, same  # round to nearest on both sides; a division's last bit aside


def test_a_second_engine_fuses_the_fp8_layers_again(tiny_model):
    # the first engine leaves FP8 layers behind (quantised while fused, unfused at shutdown); a
    # second engine fuses them again with their scales, and its small-batch forward runs on them
    model = tiny_model("llama")
    opts = dict(quantization="fp8", attention_backend="triton", async_scheduling=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 20)]
    params = hf_paged.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = []
    for _ in range(2):
        engine = hf_paged.Engine(model, small_batch_rows=2, **opts)
        try:
            assert engine.num_fused_projections > 0
            assert engine.runner.forward.small_batch is not None
            outs.append([o.output_token_ids for o in engine.generate(prompts, params)])
        finally:
            engine.shutdown()
        assert all(type(m) is not nn.Linear for m in model.model.layers.modules())
    assert outs[0] == outs[1]
