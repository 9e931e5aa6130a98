"""The small-batch kernels' weight loads carry an L2 evict-first hint, and nothing else does.

Compiled for sm_90 (Hopper) on the CPU: Triton lowers a kernel to PTX without a GPU, so the hint
is checked where it lives, in the load instructions (kernels/fused_gemv.py load_weights says why
it is there; the interpreter ignores cache hints, so no CPU run could show it). The loads of the
previous kernel's output (x, after griddepcontrol.wait) must stay plain: an evict-first line
there would be the first thing L2 drops. The compile runs in a subprocess without
TRITON_INTERPRET (under the interpreter, which tests/conftest.py turns on, @triton.jit gives no
compilable kernel): `python tests/test_kernels_cache_hints.py DIR` writes the PTX files.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_HINTED = re.compile(r"ld\.global\.[\w:.]*L2::cache_hint")
_POLICY = re.compile(r"createpolicy\.fractional\.L2::evict_first")


def _ptx(kernel, types: dict, constexprs: dict, num_warps: int) -> str:
    """PTX of kernel for sm_90: pointers (and the listed strides) 16-divisible, as a launch on
    aligned tensors specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: types.get(n, "constexpr") for n in names}
    aligned = [n for n, t in types.items() if t.startswith("*") or n.startswith("stride")]
    src = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    return compiled.asm["ptx"]


def _gemv_ptx() -> str:
    fg = importlib.import_module("hf_paged.kernels.fused_gemv")
    ptrs = ("x_ptr", "rows_ptr", "nw_ptr", "w_ptr", "w2_ptr", "b_ptr", "r_ptr", "y_ptr")
    types = {p: "*bf16" for p in ptrs}
    types.update(M="i32", N="i32", eps="fp32")
    types.update({s: "i32" for s in fg._fused_gemv_kernel.arg_names if s.startswith("stride")})
    const = dict(K=2048, K_PAD=2048, BLOCK_M=1, BLOCK_N=4, NORM=True, NORM_PLUS_ONE=False,
                 GATED=True, GELU_TANH=False, HAS_BIAS=False, RESIDUAL=True, GATHER=False, PDL=True,
                 ROWS_I32=True)  # fmt: skip
    return _ptx(fg._fused_gemv_kernel, types, const, num_warps=8)


def _qkv_ptx() -> str:
    kernel = importlib.import_module("hf_paged.kernels.qkv_rope")._norm_qkv_rope_kernel
    types = {p: "*bf16" for p in ("x_ptr", "nw_ptr", "w_ptr", "b_ptr", "cos_ptr", "sin_ptr",
                                  "q_ptr", "kc_ptr", "vc_ptr")}  # fmt: skip
    types.update(pos_ptr="*i64", slot_ptr="*i64", M="i32", eps="fp32")
    types.update({s: "i32" for s in kernel.arg_names if s.startswith("stride")})
    const = dict(K=2048, K_PAD=2048, BLOCK_M=1, PAIRS=4, HALF=32, NUM_Q_HEADS=32, NUM_KV_HEADS=4,
                 PAGE_SIZE=16, HAS_BIAS=False, PDL=True)  # fmt: skip
    return _ptx(kernel, types, const, num_warps=4)


def _rows_ptx() -> str:
    kernel = importlib.import_module("hf_paged.kernels.fused_gemm_rows")._fused_gemm_rows_kernel
    ptrs = ("x_ptr", "rows_ptr", "nw_ptr", "w_ptr", "w2_ptr", "b_ptr", "r_ptr", "y_ptr", "no_ptr")
    types = {p: "*bf16" for p in ptrs}
    types.update(M="i32", N="i32", eps="fp32")
    types.update({s: "i32" for s in kernel.arg_names if s.startswith("stride")})
    const = dict(K=4096, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, NORM=True, NORM_PLUS_ONE=False,
                 GATED=True, GELU_TANH=False, HAS_BIAS=False, RESIDUAL=False, GATHER=False,
                 NORM_OUT=False, PDL=True, IEEE=False, UPCAST=False)  # fmt: skip
    return _ptx(kernel, types, const, num_warps=4)


_KERNELS = {"fused_gemv": _gemv_ptx, "qkv_rope": _qkv_ptx, "fused_gemm_rows": _rows_ptx}
_WHOLE_TILE = ("fused_gemv", "qkv_rope")  # weights loaded whole before the PDL wait


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict:
    """{kernel: PTX}, compiled once in a subprocess without the interpreter."""
    out = tmp_path_factory.mktemp("ptx")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, __file__, str(out)], env=env, check=True, timeout=600)
    return {name: (out / f"{name}.ptx").read_text() for name in _KERNELS}


def _loads_after_wait(text: str) -> list[str]:
    tail = text.split("griddepcontrol.wait", 1)[1]
    return [line for line in tail.splitlines() if "ld.global" in line]


@pytest.mark.parametrize("kernel", _WHOLE_TILE)
def test_weight_loads_are_evict_first_and_activations_are_not(ptx, kernel):
    text = ptx[kernel]
    assert "griddepcontrol.wait" in text  # PDL: the weights are loaded before it
    before = text.split("griddepcontrol.wait", 1)[0]
    assert _POLICY.search(before)
    assert len(_HINTED.findall(before)) >= 4  # the weight tile's vector loads
    after = _loads_after_wait(text)
    assert after, "x (the previous kernel's output) is loaded after the wait"
    assert not any(_HINTED.search(line) for line in after), after


def test_pipelined_weight_copies_are_evict_first_and_activations_are_not(ptx):
    """fused_gemm_rows walks K in tiles that Triton pipelines through shared memory: the
    weights' asynchronous copies carry the hint, x's (the previous kernel's output) do not."""
    text = ptx["fused_gemm_rows"]
    assert _POLICY.search(text)
    copies = [line for line in text.splitlines() if "cp.async.cg.shared.global" in line]
    hinted = [line for line in copies if "L2::cache_hint" in line]
    assert len(hinted) >= 8  # two weight tiles a stage, several 16-byte copies a thread each
    assert len(copies) > len(hinted)  # x's tiles, plain


if __name__ == "__main__":
    for name, compile_ptx in _KERNELS.items():
        Path(sys.argv[1], f"{name}.ptx").write_text(compile_ptx())
