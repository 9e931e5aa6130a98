"""FP8 weights (`quantization="fp8"`): the model's linear layers quantised at start-up.

Each weight [N, K] becomes float8_e4m3fn with one float32 scale per output channel (row amax /
448), and the original weight is released. The product is y = (x @ w8.T) * scale (+ bias),
computed by `fp8_linear` three ways:
  - CPU, or shapes the FP8 GEMM does not take: weight-only, the FP8 weight cast to the
    activations' dtype (kernels/fp8_gemv.py's fp8_gemv_ref);
  - CUDA, at most kernels.fp8_gemv.MAX_ROWS rows (small-batch decode): the Triton FP8 GEMV, which
    streams each weight byte once;
  - CUDA on sm89+ (Ada, Hopper), more rows: torch._scaled_mm on FP8 activations quantised per
    token (a dynamic row scale), the FP8 tensor cores' product.
The fused q/k/v and gate/up projections (integrations/fused_projections.py) are quantised as
their fused matrix (same per-row scales: slicing rows slices the scales). lm_head and embeddings
stay in the model's dtype (tied to the embedding in many models, and the logits' precision).
After the engine the model keeps its FP8 layers: the original weights are gone.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANTIZATION_METHODS = ("fp8",)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 per-row scale) with weight ~= w8 * scale[:, None]."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _scaled_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0


def fp8_linear(x, weight, scale, bias=None):
    """x [..., K] @ (scale[:, None] * weight).T (+ bias), in x's dtype."""
    from hf_paged.kernels.fp8_gemv import MAX_ROWS, fp8_gemv_ref

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    if x.is_cuda and 1 <= rows <= MAX_ROWS:
        out = torch.ops.hf_paged.fp8_gemv(x2.contiguous(), weight, scale, bias)
    elif rows and _scaled_mm_ok(x2, weight):
        # dynamic per-token activation scales: each row's amax onto the format's range
        x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        x8 = (x2 / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out = torch._scaled_mm(
            x8, weight.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype
        )
        if bias is not None:
            out = out + bias
    else:
        out = fp8_gemv_ref(x2, weight, scale, bias)
    return out.reshape(*shape[:-1], weight.shape[0])


@torch.library.custom_op("hf_paged::fp8_gemv", mutates_args=())
def _fp8_gemv_op(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # opaque to torch.compile: one op, not the Triton launcher's Python
    from hf_paged.kernels.fp8_gemv import fp8_gemv

    return fp8_gemv(x, weight, scale, bias)


@_fp8_gemv_op.register_fake
def _(x, weight, scale, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


class Fp8Linear(nn.Module):
    """Stands where an nn.Linear was: its weight in FP8 with per-output-channel scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w8, scale = quantize_weight(linear.weight)
        self.weight = nn.Parameter(w8, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        """From an already quantised weight (a fused projection's rows, when unfused)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight.shape
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.register_buffer("weight_scale", scale)
        layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3"


def check_quantizable(model: nn.Module, method) -> None:
    """Refuse, naming the field, what quantization cannot apply to."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be None or one of {QUANTIZATION_METHODS}, got {method!r}"
        )
    config_q = getattr(model.config, "quantization_config", None)
    if config_q is not None:
        kind = getattr(config_q, "quant_method", None) or type(config_q).__name__
        raise ValueError(
            f"quantization={method!r}: the model is already quantised ({kind}) as loaded; "
            "run it as it is (quantization=None)"
        )
    if hasattr(model, "peft_config"):
        raise ValueError(
            f"quantization={method!r} on a PeftModel is not supported (LoRA layers wrap the "
            "linears it would replace)"
        )
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"quantization={method!r}: the model's dtype {dtype} is not a float dtype")


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantise the model's linear layers (fused projections as one matrix) in place; returns
    how many matrices are FP8 (those an earlier Engine quantised included). lm_head (the
    output embedding) is left as it is."""
    from hf_paged.integrations.fused_projections import FusedProjection

    check_quantizable(model, method)
    skip = model.get_output_embeddings()
    count = 0
    for module in list(model.modules()):
        if isinstance(module, FusedProjection):
            if module.weight.dtype != FP8:
                w8, scale = quantize_weight(module.weight)
                module.weight = nn.Parameter(w8, requires_grad=False)
                module.register_buffer("weight_scale", scale)
            count += 1
        elif isinstance(module, Fp8Linear):  # quantised by an earlier Engine on this model
            count += 1
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not skip:
                setattr(module, name, Fp8Linear(child))
                count += 1
    if count == 0:
        raise ValueError(f"quantization={method!r}: the model has no nn.Linear layers to quantise")
    return count
