"""kernels/fused_gemv.py, kernels/rope_kv.py and kernels/residual_norm.py under the Triton
interpreter, against their torch
references (which compute what transformers' RMSNorm / Linear / SiLU-mul / residual add /
apply_rotary_pos_emb modules compute), and their refusals of bad inputs."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_paged.kernels import (
    fused_gemv,
    fused_gemv_ref,
    gemv_tiles,
    rope_write_kv,
    rope_write_kv_ref,
)

fg = importlib.import_module("hf_paged.kernels.fused_gemv")

K, N = 96, 40  # K not a power of 2: the kernel pads the tile and masks


def _inputs(dtype, rows, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return dict(
        x=rnd(rows + 2, K),
        w=rnd(N, K, scale=0.1),
        w2=rnd(N, K, scale=0.1),
        nw=rnd(K).abs() + 0.5,
        b=rnd(N),
        r=rnd(rows, N),
        rows=torch.randperm(rows + 2, generator=g)[:rows],
    )


OPTIONS = {
    "plain": lambda t: {},
    "norm": lambda t: dict(norm_weight=t["nw"], eps=1e-5),
    "gated": lambda t: dict(up_weight=t["w2"]),
    "norm_gated": lambda t: dict(norm_weight=t["nw"], eps=1e-6, up_weight=t["w2"]),
    "bias_residual": lambda t: dict(bias=t["b"], residual=t["r"]),
    "norm_gather": lambda t: dict(norm_weight=t["nw"], eps=1e-5, rows=t["rows"]),
    # Gemma 2: (1 + w) norm, rounded once; GELU(tanh) gate (gate values wide enough to reach
    # tanh's flat ends)
    "gemma_norm_gelu": lambda t: dict(
        norm_weight=t["nw"] - 1.0,
        eps=1e-6,
        up_weight=t["w2"],
        norm_plus_one=True,
        activation="gelu_tanh",
    ),  # fmt: skip
    "gemma_norm_gather": lambda t: dict(
        norm_weight=t["nw"] - 1.0, eps=1e-6, rows=t["rows"], norm_plus_one=True
    ),
}


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_fused_gemv_matches_reference(rows, dtype, option):
    t = _inputs(dtype, rows)
    kw = OPTIONS[option](t)
    x = t["x"] if "rows" in kw else t["x"][:rows]
    got = fused_gemv(x, t["w"], **kw).float()
    want = fused_gemv_ref(x, t["w"], **kw).float()
    # float32: summation order only. bf16: the interpreter truncates float32 -> bf16 where the
    # GPU rounds (tests/test_kernels_gpu.py checks the GPU at real shapes), ~1-2 bf16 ulps here.
    tol = 1e-5 if dtype == torch.float32 else 1e-1
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("k", [96, 300])  # one scale block (K < 128); three, the last partial
@pytest.mark.parametrize("option", ["plain", "norm_gated", "bias_residual"])
def test_fused_gemv_fp8_weights_match_the_dequantised_reference(rows, k, option):
    # FP8 weights with 1x128 block scales (Fp8Linear's layout, N-major scales): the kernel
    # dequantises its tile in registers; blocks of different magnitude, so a wrong block's
    # scale shows; gate and up as row slices of one fused matrix, as the small-batch forward
    # passes them
    from hf_paged.quantization.fp8_weights import quantize_weight

    g = torch.Generator().manual_seed(1)
    blocks = torch.rand(-(-k // 128), generator=g) * 4 + 0.25
    w = torch.randn(2 * N, k, generator=g) * 0.1 * blocks.repeat_interleave(128)[:k]
    w8, scale = quantize_weight(w)
    x = torch.randn(rows, k, generator=g)
    kw = dict(weight_scale=scale[:N])
    if option == "norm_gated":
        kw.update(norm_weight=torch.rand(k, generator=g) + 0.5, eps=1e-5)
        kw.update(up_weight=w8[N:], up_scale=scale[N:])
    elif option == "bias_residual":
        kw.update(bias=torch.randn(N, generator=g), residual=torch.randn(rows, N, generator=g))
    got = fused_gemv(x, w8[:N], **kw)
    want = fused_gemv_ref(x, w8[:N], **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if option == "plain":  # the product Fp8Linear computes
        from hf_paged.kernels.fp8_gemv import fp8_gemv_ref

        torch.testing.assert_close(got, fp8_gemv_ref(x, w8[:N], scale[:N]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gemv_writes_the_normalised_rows(rows, dtype):
    # norm_out: the RMSNorm'd input as transformers' RMSNorm gives it (a LoRA delta's input)
    t = _inputs(dtype, rows)
    x = t["x"][:rows]
    out = torch.full((rows, K), float("nan"), dtype=dtype)
    y = fused_gemv(x, t["w"], norm_weight=t["nw"], eps=1e-5, norm_out=out)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-1, rtol=2e-2)
    torch.testing.assert_close(out, fg.rms_norm_ref(x, t["nw"], 1e-5), **tol)
    torch.testing.assert_close(y, fused_gemv(x, t["w"], norm_weight=t["nw"], eps=1e-5))
    with pytest.raises(ValueError, match="norm_out needs norm_weight"):
        fused_gemv(x, t["w"], norm_out=out)


def _every_fp8_code_case(device):
    # all 254 float8_e4m3fn codes but the two NaNs (subnormals, zeros of both signs, +-448) in
    # every column (row n, column j: code (n + j) mod 254), two blocks of 128 columns with
    # power-of-2 scales per row, and one-hot rows: each output is one decoded weight times its
    # scale, exactly representable, so any bit the decode gets wrong (a flushed subnormal, a
    # lost sign) shows as an inequality
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    idx = (torch.arange(254)[:, None] + torch.arange(256)[None, :]) % 254
    w8 = codes[idx].view(torch.float8_e4m3fn)
    scale = 2.0 ** torch.randint(-12, 4, (254, 2), generator=torch.Generator().manual_seed(0))
    cols = torch.tensor([0, 1, 127, 128, 200, 255])
    x = torch.nn.functional.one_hot(cols, 256).float()
    want = (w8.float() * scale.repeat_interleave(128, dim=1))[:, cols].T
    return x.to(device), w8.to(device), scale.to(device), want.to(device)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])],
)  # fmt: skip
def test_fused_gemv_decodes_every_fp8_code_exactly(device):
    x, w8, scale, want = _every_fp8_code_case(device)
    got = fused_gemv(x, w8, weight_scale=scale)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_fused_gemv_fp8_refuses_missing_or_stray_scales():
    from hf_paged.quantization.fp8_weights import quantize_weight

    w8, scale = quantize_weight(torch.randn(N, K))
    x = torch.randn(1, K)
    with pytest.raises(ValueError, match="weight_scale"):
        fused_gemv(x, w8)
    with pytest.raises(ValueError, match="weight_scale"):
        fused_gemv(x, w8.float(), weight_scale=scale)
    with pytest.raises(ValueError, match="weight_scale must be"):
        fused_gemv(x, w8, weight_scale=scale[:, :0])


def test_fused_gemv_references_are_the_transformers_modules():
    """The references the kernel is held to compute what Gemma2RMSNorm, LlamaRMSNorm and
    gelu_pytorch_tanh compute (bf16: their rounding points differ, so the pairs must not mix)."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        t = _inputs(dtype, 3)
        x, w = t["x"], t["w"]
        gemma, llama = Gemma2RMSNorm(K, eps=1e-6).to(dtype), LlamaRMSNorm(K, eps=1e-6).to(dtype)
        with torch.no_grad():
            gemma.weight.copy_(t["nw"] - 1.0)
            llama.weight.copy_(t["nw"])
            up = torch.nn.functional.linear(gemma(x), t["w2"])
            want = ACT2FN["gelu_pytorch_tanh"](torch.nn.functional.linear(gemma(x), w)) * up
        kw = dict(norm_weight=t["nw"] - 1.0, eps=1e-6, up_weight=t["w2"], norm_plus_one=True)
        assert torch.equal(fused_gemv_ref(x, w, activation="gelu_tanh", **kw), want)
        want = torch.nn.functional.linear(llama(x), w)
        assert torch.equal(fused_gemv_ref(x, w, norm_weight=t["nw"], eps=1e-6), want)


@pytest.mark.parametrize(
    "config",  # the GPU's narrow tiles: many programs, a partial last one (N=40 by 8)
    [dict(BLOCK_N=4, num_warps=4), dict(BLOCK_N=8, num_warps=4)],
)
@pytest.mark.parametrize(
    "option", ["norm_gated", "bias_residual", "norm_gather", "gemma_norm_gelu"]
)
def test_fused_gemv_gpu_tile_shapes(config, option):
    t = _inputs(torch.float32, 3)
    kw = OPTIONS[option](t)
    x = t["x"] if "rows" in kw else t["x"][:3]
    got = fused_gemv(x, t["w"], config=dict(config), **kw)
    torch.testing.assert_close(got, fused_gemv_ref(x, t["w"], **kw), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("option", ["plain", "norm_gated"])
def test_fused_gemv_weight_rows_with_a_stride(option):
    # a column slice of a wider matrix: rows not back to back, so 64-bit offsets by the row
    # stride (contiguous weights take 32-bit offsets with K as the stride)
    t = _inputs(torch.float32, 3)
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(2, N, K + 8, generator=g) * 0.1
    w, w2 = wide[0, :, :K], wide[1, :, :K]
    assert not fg._rows_i32(w) and fg._rows_i32(t["w"])
    kw = OPTIONS[option](t)
    if "up_weight" in kw:
        kw["up_weight"] = w2
    x = t["x"][:3]
    got = fused_gemv(x, w, config=dict(BLOCK_N=4, num_warps=4), **kw)
    torch.testing.assert_close(got, fused_gemv_ref(x, w, **kw), atol=1e-5, rtol=1e-5)


def test_tile_config_keeps_the_weight_tile_in_registers():
    assert gemv_tiles.tile_config(2048, gated=False) == dict(BLOCK_N=4, num_warps=4)
    assert gemv_tiles.tile_config(14336, gated=False)["num_warps"] <= 16  # Llama-3-8B down_proj
    assert gemv_tiles.tile_config(1 << 20, gated=True) is None
    with pytest.raises(ValueError, match="does not fit"):
        fused_gemv(torch.zeros(1, 1 << 16), torch.zeros(4, 1 << 16))


def test_tile_config_long_gemvs_take_fewer_rows_before_more_warps():
    # Llama-3-8B down_proj (117 MB) and gate/up (235 MB): at most 8 warps a program
    assert gemv_tiles.tile_config(14336, False, 4096 * 14336 * 2) == dict(BLOCK_N=1, num_warps=8)
    assert gemv_tiles.tile_config(4096, True, 2 * 14336 * 4096 * 2) == dict(BLOCK_N=2, num_warps=8)
    # the 1.1B down_proj (23 MB, bf16): 8 rows x 8 warps, one wave; in fp32 the wider tile
    assert gemv_tiles.tile_config(5632, False, 2048 * 5632 * 2) == dict(BLOCK_N=8, num_warps=8)
    assert gemv_tiles.tile_config(5632, False, 2048 * 5632 * 4, 4) == dict(BLOCK_N=4, num_warps=16)
    # a K no 8-warp tile holds still gets 16
    assert gemv_tiles.tile_config(18944, False, 1 << 30) == dict(BLOCK_N=1, num_warps=16)


def test_tile_config_fp8_weights_hold_256_a_thread_in_4_warps():
    from hf_paged.kernels.qkv_rope import qkv_rope_config

    # the Llama-3-8B projections' FP8 tiles: q/k/v and o 8 rows, gate/up 4, down 2, 4 warps
    assert gemv_tiles.tile_config(4096, False, 6144 * 4096, 1) == dict(BLOCK_N=8, num_warps=4)
    assert gemv_tiles.tile_config(4096, True, 2 * 14336 * 4096, 1) == dict(BLOCK_N=4, num_warps=4)
    assert gemv_tiles.tile_config(14336, False, 4096 * 14336, 1) == dict(BLOCK_N=2, num_warps=4)
    # a K one row of which needs more warps; and one no program holds
    assert gemv_tiles.tile_config(1 << 16, False, 0, 1) == dict(BLOCK_N=1, num_warps=8)
    assert gemv_tiles.tile_config(1 << 18, False, 0, 1) is None
    # norm_qkv_rope: pairs of rows, as many as divide the head's half
    assert qkv_rope_config(4096, 64, 1) == dict(PAIRS=4, num_warps=4)
    assert qkv_rope_config(1024, 4, 1) == dict(PAIRS=4, num_warps=4)
    assert qkv_rope_config(1024, 2, 1) == dict(PAIRS=2, num_warps=4)


def test_fused_gemv_refuses_bad_inputs():
    t = _inputs(torch.float32, 2)
    x, w = t["x"][:2], t["w"]
    with pytest.raises(ValueError, match="in_features"):
        fused_gemv(x[:, :50], w)
    with pytest.raises(ValueError, match="dtype"):
        fused_gemv(x, w.double())
    with pytest.raises(ValueError, match="at most 8 rows"):
        fused_gemv(torch.zeros(9, K), w)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_gemv(x, w, norm_weight=t["nw"][:10], eps=1e-5)
    with pytest.raises(ValueError, match="residual"):
        fused_gemv(x, w, residual=t["r"][:1])
    with pytest.raises(ValueError, match="up_weight"):
        fused_gemv(x, w, up_weight=w[:5])
    with pytest.raises(ValueError, match="rows"):
        fused_gemv(x, w, rows=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be contiguous"):
        fused_gemv(torch.zeros(K, 2).t(), w)
    with pytest.raises(ValueError, match="activation must be"):
        fused_gemv(x, w, up_weight=w, activation="relu")


@pytest.mark.parametrize("d", [16, 24])  # 24: halves of 12 in a tile of 16 (head_dim 96's case)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_matches_reference(dtype, d):
    g = torch.Generator().manual_seed(1)
    t, hq, hkv = 3, 4, 2
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    caches = [torch.zeros(4, 4, hkv, d, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([5, -1, 9])  # the middle token is padding: written nowhere
    q = rope_write_kv(qkv, cos, sin, caches[0], caches[1], slots, hq)
    q_ref = rope_write_kv_ref(qkv, cos, sin, caches[2], caches[3], slots, hq)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    assert torch.equal(caches[1], caches[3])
    written = caches[0].flatten(0, 1).abs().sum(dim=(1, 2)) > 0
    assert written.nonzero().flatten().tolist() == [5, 9]


@pytest.mark.parametrize("d", [16, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_with_head_norms_matches_reference(dtype, d):
    """Qwen3's q_norm / k_norm over each head before RoPE, in the same launch; the reference is
    Qwen3RMSNorm then apply_rotary_pos_emb."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(2)
    t, hq, hkv = 3, 4, 2
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    angles = torch.randn(t, d // 2, generator=g)
    cos, sin = angles.cos().repeat(1, 2).to(dtype), angles.sin().repeat(1, 2).to(dtype)
    qn, kn = Qwen3RMSNorm(d, eps=1e-6).to(dtype), Qwen3RMSNorm(d, eps=1e-6).to(dtype)
    with torch.no_grad():
        qn.weight.copy_(torch.rand(d, generator=g) + 0.5)
        kn.weight.copy_(torch.rand(d, generator=g) + 0.5)
    caches = [torch.zeros(4, 4, hkv, d, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([5, -1, 9])
    norms = dict(q_norm_weight=qn.weight.detach(), k_norm_weight=kn.weight.detach(), eps=1e-6)
    q = rope_write_kv(qkv, cos, sin, caches[0], caches[1], slots, hq, **norms)
    q_ref = rope_write_kv_ref(qkv, cos, sin, caches[2], caches[3], slots, hq, *norms.values())
    with torch.no_grad():  # the reference is the transformers modules' computation
        heads = qkv.view(t, -1, d)
        q_hf, k_hf = apply_rotary_pos_emb(qn(heads[:, :hq]), kn(heads[:, hq : hq + hkv]), cos, sin)
    assert torch.equal(q_ref, q_hf)  # [T, H, D]: cos/sin unsqueezed at dim 1 broadcast per head
    assert torch.equal(caches[2].flatten(0, 1)[[5, 9]], k_hf[[0, 2]])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    assert torch.equal(caches[1], caches[3])
    plain = rope_write_kv(qkv, cos, sin, caches[0].clone(), caches[1].clone(), slots, hq)
    assert not torch.allclose(plain, q, atol=1e-2)  # the norms did something


def test_rope_write_kv_refuses_bad_inputs():
    kc = torch.zeros(4, 4, 2, 16)
    qkv, cs = torch.zeros(3, 8 * 16), torch.zeros(3, 16)
    slots = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_write_kv(qkv[:, :100], cs, cs, kc, kc.clone(), slots, 4)
    with pytest.raises(ValueError, match="cos"):
        rope_write_kv(qkv, cs[:2], cs, kc, kc.clone(), slots, 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_write_kv(qkv, cs, cs, kc, kc.clone(), slots.int(), 4)
    odd = torch.zeros(4, 4, 2, 13)
    with pytest.raises(ValueError, match="even"):
        rope_write_kv(torch.zeros(3, 8 * 13), cs[:, :13], cs[:, :13], odd, odd.clone(), slots, 4)
    with pytest.raises(ValueError, match="come together"):
        rope_write_kv(qkv, cs, cs, kc, kc.clone(), slots, 4, q_norm_weight=torch.ones(16))
    with pytest.raises(ValueError, match="q_norm_weight must be"):
        rope_write_kv(qkv, cs, cs, kc, kc.clone(), slots, 4, q_norm_weight=torch.ones(8),
                      k_norm_weight=torch.ones(8))  # fmt: skip


@pytest.mark.parametrize(
    "dtype, rows, bias, strided",
    [(dt, r, b, False) for dt in (torch.float32, torch.bfloat16) for r in (1, 3) for b in (0, 1)]
    + [(torch.float32, 3, False, True)],  # weight rows with a stride: 64-bit offsets
)
def test_norm_qkv_rope_matches_reference(dtype, rows, bias, strided):
    from hf_paged.kernels import norm_qkv_rope, norm_qkv_rope_ref

    g = torch.Generator().manual_seed(rows)
    hq, hkv, d = 4, 2, 16
    n = (hq + 2 * hkv) * d
    x = torch.randn(rows, K, generator=g).to(dtype)
    w = (torch.randn(n, K + 8 * strided, generator=g) * 0.1).to(dtype)[:, :K]
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    angles = torch.randn(50, d // 2, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 50, (rows,), generator=g)
    slots = torch.tensor([5, -1, 9])[:rows]
    caches = [torch.zeros(4, 4, hkv, d, dtype=dtype) for _ in range(4)]
    args = (positions, cos, sin)
    # the interpreter's default tile is a head a program; the GPU's two pairs a program (four
    # programs a head here) tested too
    config = dict(PAIRS=2, num_warps=4) if rows == 3 else None
    q = norm_qkv_rope(x, w, b, nw, 1e-5, *args, caches[0], caches[1], slots, hq, config=config)
    q_ref = norm_qkv_rope_ref(x, w, b, nw, 1e-5, *args, caches[2], caches[3], slots, hq)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-1, rtol=5e-2)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)  # keys, rotated
    torch.testing.assert_close(caches[1], caches[3], **tol)  # values
    written = caches[1].flatten(0, 1).abs().sum(dim=(1, 2)) > 0
    assert written.nonzero().flatten().tolist() == [5, 9][: 1 if rows == 1 else 2]


@pytest.mark.parametrize("rows", [1, 2])
def test_norm_qkv_rope_fp8_weight_matches_the_dequantised_reference(rows):
    # Fp8Linear's fused q/k/v matrix: FP8 rows and their 1x128 block scales, K over 2 blocks
    from hf_paged.kernels import norm_qkv_rope, norm_qkv_rope_ref

    from hf_paged.quantization.fp8_weights import quantize_weight

    g = torch.Generator().manual_seed(rows)
    hq, hkv, d, k = 4, 2, 16, 200
    n = (hq + 2 * hkv) * d
    x = torch.randn(rows, k, generator=g)
    w8, scale = quantize_weight(torch.randn(n, k, generator=g) * torch.linspace(0.05, 0.4, k))
    nw = torch.rand(k, generator=g) + 0.5
    angles = torch.randn(50, d // 2, generator=g)
    args = (torch.randint(0, 50, (rows,), generator=g), angles.cos(), angles.sin())
    slots = torch.tensor([5, 9])[:rows]
    caches = [torch.zeros(4, 4, hkv, d) for _ in range(4)]
    q = norm_qkv_rope(
        x, w8, None, nw, 1e-5, *args, caches[0], caches[1], slots, hq, weight_scale=scale
    )
    q_ref = norm_qkv_rope_ref(
        x, w8, None, nw, 1e-5, *args, caches[2], caches[3], slots, hq, weight_scale=scale
    )
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    torch.testing.assert_close(caches[1], caches[3], **tol)
    with pytest.raises(ValueError, match="weight_scale"):
        norm_qkv_rope(x, w8, None, nw, 1e-5, *args, caches[0], caches[1], slots, hq)


def test_norm_qkv_rope_refuses_bad_inputs():
    from hf_paged.kernels import norm_qkv_rope

    kc = torch.zeros(4, 4, 2, 16)
    x, w, nw = torch.zeros(2, K), torch.zeros(8 * 16, K), torch.ones(K)
    tab, pos, slots = torch.zeros(10, 8), torch.zeros(2, dtype=torch.long), torch.zeros(2).long()

    def call(**kw):
        a = dict(x=x, weight=w, bias=None, norm_weight=nw, eps=1e-5, positions=pos)
        a.update(cos_table=tab, sin_table=tab, key_cache=kc, value_cache=kc.clone())
        a.update(slot_mapping=slots, num_q_heads=4)
        a.update(kw)
        return norm_qkv_rope(**a)

    call()  # the valid call runs
    with pytest.raises(ValueError, match="weight must be"):
        call(weight=w[:-16])
    with pytest.raises(ValueError, match="at most 8 tokens"):
        call(
            x=torch.zeros(9, K), positions=torch.zeros(9).long(), slot_mapping=torch.zeros(9).long()
        )
    with pytest.raises(ValueError, match="cos_table"):
        call(cos_table=torch.zeros(10, 16))
    with pytest.raises(ValueError, match="positions"):
        call(positions=pos.int())
    with pytest.raises(ValueError, match="value_cache"):
        call(value_cache=kc.double())


@pytest.mark.parametrize("plus_one", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_rms_norm_matches_reference(plus_one, dtype):
    """Gemma 2's sandwich norm and add (residual + Gemma2RMSNorm(x)) in one launch; the
    reference equals the transformers module."""
    from hf_paged.kernels import residual_rms_norm, residual_rms_norm_ref
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(4)
    x, r = (torch.randn(3, K, generator=g) * 4).to(dtype), torch.randn(3, K, generator=g).to(dtype)
    module = (Gemma2RMSNorm if plus_one else LlamaRMSNorm)(K, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(K, generator=g) * 0.5)
        want = r + module(x)
    w = module.weight.detach()
    assert torch.equal(residual_rms_norm_ref(x, r, w, 1e-6, plus_one), want)
    got = residual_rms_norm(x, r, w, 1e-6, plus_one)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-1, rtol=5e-2)
    torch.testing.assert_close(got, want, **tol)
    one_row = residual_rms_norm(x[1:2], r[1:2], w, 1e-6, plus_one)
    torch.testing.assert_close(one_row, want[1:2], **tol)


def test_residual_rms_norm_refuses_bad_inputs():
    from hf_paged.kernels import residual_rms_norm

    x, w = torch.zeros(2, K), torch.ones(K)
    with pytest.raises(ValueError, match="one \\[R, N\\] shape"):
        residual_rms_norm(x, x[:1], w, 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        residual_rms_norm(x, x.double(), w, 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        residual_rms_norm(torch.zeros(K, 2).t(), x, w, 1e-6)
