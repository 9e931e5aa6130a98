"""The row math the small-batch products share (kernels/fused_gemv.py, kernels/fused_gemm_rows.py),
rounded as the transformers modules they replace round, so both kernels compute the same values.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_scale(xn, g, dt, PLUS_ONE: tl.constexpr):
    # xn = x * (1 / rms) in float32, g the norm weight (float32, broadcast to xn): LlamaRMSNorm
    # rounds the normalised x to the model dtype, then multiplies by its weight in that dtype;
    # Gemma2RMSNorm (PLUS_ONE) computes x * (1 + w) in float32 and rounds once
    if PLUS_ONE:
        return (xn * (1.0 + g)).to(dt)
    return (g * xn.to(dt).to(tl.float32)).to(dt)


@triton.jit
def gate_activation(gate, GELU_TANH: tl.constexpr):
    # SiLU, or GELU with the tanh approximation (Gemma 2's gelu_pytorch_tanh), in float32;
    # tanh(u) = 1 - 2 / (exp(2u) + 1): inf-safe both ways
    if GELU_TANH:
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    return gate / (1.0 + tl.exp(-gate))
