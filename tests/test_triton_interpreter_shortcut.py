"""The CPU suite's shortcut in Triton's interpreter (tests/triton_interpreter.py) is installed,
takes effect (a kernel's helper calls stop re-patching triton.language after the first), and
leaves results as they were."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only (the CPU suite)"
)


@triton.jit
def _scaled(x, scale):
    return x * scale


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, scale, N: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * N + tl.arange(0, N))
    tl.store(out_ptr + row, tl.sum(_scaled(x, scale), axis=0))  # two helpers: ours, Triton's


def test_helper_calls_patch_once_a_launch(monkeypatch):
    from triton.runtime import interpreter as interp

    assert getattr(interp.InterpretedFunction.__call__, "_hf_paged", False)
    patches = []
    real = interp._patch_lang

    def counted(fn):
        patches.append(fn.__name__)
        return real(fn)

    monkeypatch.setattr(interp, "_patch_lang", counted)
    x = torch.randn(6, 16)
    out = torch.empty(6)
    _row_sums_kernel[(6,)](x, out, 0.5, N=16)
    torch.testing.assert_close(out, (x * 0.5).sum(dim=1))
    # the launch, then tl.sum's first call (it sees triton.language.core, which the kernel's
    # module does not): 2 of the 1 + 12 the interpreter alone would make
    assert len(patches) == 2, patches
