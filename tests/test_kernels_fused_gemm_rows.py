"""kernels/fused_gemm_rows.py (fused_gemv's tensor-core kernel for 3+ rows) under the Triton
interpreter against fused_gemv_ref, at the GPU's tile shapes (several K tiles, a partial last
one, several column programs), and which calls fused_gemv routes to it."""

from __future__ import annotations

import importlib

import pytest
import torch
from hf_paged.kernels import ROW_SERIAL_ROWS, fused_gemm_rows, fused_gemv, fused_gemv_ref

from tests.test_kernels_fused_gemv import OPTIONS, _inputs

fg = importlib.import_module("hf_paged.kernels.fused_gemv")

# N=40 by 16 columns: three programs, the last partial; K=96 by 32 or 64: three tiles, or two
# with a partial last one
CONFIGS = [
    dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2),
    dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=4),
]


@pytest.mark.parametrize("rows", [3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", range(len(CONFIGS)))
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_fused_gemm_rows_matches_reference(rows, dtype, config, option):
    t = _inputs(dtype, rows)
    kw = OPTIONS[option](t)
    x = t["x"] if "rows" in kw else t["x"][:rows]
    got = fused_gemm_rows(x, t["w"], config=dict(CONFIGS[config]), **kw).float()
    want = fused_gemv_ref(x, t["w"], **kw).float()
    # float32: IEEE products, summation order only. bf16: the interpreter truncates where the
    # GPU rounds (tests/test_kernels_gpu.py holds the GPU to the reference at real shapes)
    tol = 1e-5 if dtype == torch.float32 else 1e-1
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("plus_one", [False, True])
def test_fused_gemm_rows_writes_the_normalised_rows(plus_one):
    t = _inputs(torch.float32, 5)
    x = t["x"][:5]
    normed = torch.full_like(x, float("nan"))
    kw = dict(norm_weight=t["nw"], eps=1e-6, norm_plus_one=plus_one)
    got = fused_gemm_rows(x, t["w"], norm_out=normed, config=dict(CONFIGS[0]), **kw)
    torch.testing.assert_close(got, fused_gemv_ref(x, t["w"], **kw), atol=1e-5, rtol=1e-5)
    want = fg.rms_norm_ref(x, t["nw"], 1e-6, plus_one)
    torch.testing.assert_close(normed, want, atol=1e-6, rtol=1e-6)


def test_fused_gemm_rows_a_weight_with_a_row_stride():
    # a column slice of a wider matrix (the fused gate/up weight's halves are row slices; a
    # checkpoint's fused projections may be column views)
    t = _inputs(torch.float32, 4)
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 40, 96 + 8, generator=g) * 0.1
    w, w2 = wide[0, :, :96], wide[1, :, :96]
    x = t["x"][:4]
    kw = dict(norm_weight=t["nw"], eps=1e-6, up_weight=w2)
    got = fused_gemm_rows(x, w, config=dict(CONFIGS[0]), **kw)
    torch.testing.assert_close(got, fused_gemv_ref(x, w, **kw), atol=1e-5, rtol=1e-5)


def test_fused_gemv_routes_rows_past_the_serial_kernel_here(monkeypatch):
    """More than ROW_SERIAL_ROWS rows of float weights without LoRA: the tensor-core kernel;
    fewer rows, FP8 weights, LoRA or a tile config of the row-serial kernel: the row-serial one."""
    calls = []
    real = fg.fused_gemm_rows
    monkeypatch.setattr(fg, "fused_gemm_rows", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    t = _inputs(torch.float32, 8)
    for rows, extra, routed in (
        (ROW_SERIAL_ROWS, {}, False),
        (ROW_SERIAL_ROWS + 1, {}, True),
        (8, {}, True),
        (8, dict(config=dict(BLOCK_N=4, num_warps=4)), False),
    ):
        calls.clear()
        x = t["x"][:rows]
        got = fused_gemv(x, t["w"], norm_weight=t["nw"], eps=1e-6, **extra)
        assert bool(calls) == routed, (rows, extra)
        want = fused_gemv_ref(x, t["w"], norm_weight=t["nw"], eps=1e-6)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # FP8 weights stay on the row-serial kernel at any row count
    w8 = (t["w"] * 4).to(torch.float8_e4m3fn)
    scale = torch.full((40, 1), 0.25)
    calls.clear()
    fused_gemv(t["x"][:8], w8, weight_scale=scale)
    assert not calls


def test_fused_gemm_rows_no_rows():
    t = _inputs(torch.float32, 3)
    assert fused_gemm_rows(t["x"][:0], t["w"]).shape == (0, 40)
