"""kernels/fused_gemv.py and kernels/rope_kv.py under the Triton interpreter, against their torch
references (which compute what transformers' RMSNorm / Linear / SiLU-mul / residual add /
apply_rotary_pos_emb modules compute), and their refusals of bad inputs."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_paged.kernels import fused_gemv, fused_gemv_ref, rope_write_kv, rope_write_kv_ref

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


@pytest.mark.parametrize(
    "config",  # the GPU's narrow tiles: many programs, a partial last one (N=40 by 8)
    [dict(BLOCK_N=4, num_warps=4), dict(BLOCK_N=8, num_warps=4)],
)
@pytest.mark.parametrize("option", ["norm_gated", "bias_residual", "norm_gather"])
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
    assert fg.tile_config(2048, gated=False) == dict(BLOCK_N=4, num_warps=4)
    assert fg.tile_config(14336, gated=False)["num_warps"] <= 16  # Llama-3-8B down_proj
    assert fg.tile_config(1 << 20, gated=True) is None
    with pytest.raises(ValueError, match="does not fit"):
        fused_gemv(torch.zeros(1, 1 << 16), torch.zeros(4, 1 << 16))


def test_tile_config_long_gemvs_take_fewer_rows_before_more_warps():
    # Llama-3-8B down_proj (117 MB) and gate/up (235 MB): at most 8 warps a program
    assert fg.tile_config(14336, False, 4096 * 14336 * 2) == dict(BLOCK_N=1, num_warps=8)
    assert fg.tile_config(4096, True, 2 * 14336 * 4096 * 2) == dict(BLOCK_N=2, num_warps=8)
    # the 1.1B down_proj (23 MB, bf16): 8 rows x 8 warps, one wave; in fp32 the wider tile
    assert fg.tile_config(5632, False, 2048 * 5632 * 2) == dict(BLOCK_N=8, num_warps=8)
    assert fg.tile_config(5632, False, 2048 * 5632 * 4, 4) == dict(BLOCK_N=4, num_warps=16)
    # a K no 8-warp tile holds still gets 16
    assert fg.tile_config(18944, False, 1 << 30) == dict(BLOCK_N=1, num_warps=16)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d = 3, 4, 2, 16
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
    odd = torch.zeros(4, 4, 2, 12)
    with pytest.raises(ValueError, match="power of 2"):
        rope_write_kv(torch.zeros(3, 8 * 12), cs[:, :12], cs[:, :12], odd, odd.clone(), slots, 4)


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
    q = norm_qkv_rope(x, w, b, nw, 1e-5, *args, caches[0], caches[1], slots, hq)
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
