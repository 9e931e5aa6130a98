"""FP8 weights (`quantization="fp8"`): the model's linear layers quantised at start-up.

Each weight [N, K] becomes float8_e4m3fn with one float32 scale per block of 128 input columns
of each output row (scale [N, ceil(K / 128)], block amax / 448: FineGrainedFP8's 1x128 blocks), and
the original weight is released. Blocks rather than whole rows: each block's largest weight maps
exactly onto 448, and on SmolLM2-135M the perplexity cost of FP8 weights fell from +2.27% (per
row) to +1.52% (docs/quantization.md). The product y = x @ dequantised(w8).T (+ bias) is
computed by `fp8_linear` three ways:
  - CPU, or shapes no FP8 kernel takes: weight-only, the weight dequantised to the activations'
    dtype (kernels/fp8_gemv.py's fp8_gemv_ref);
  - CUDA, at most kernels.fp8_gemv.MAX_ROWS rows (small-batch decode): the Triton FP8 GEMV, which
    streams each weight byte once and applies each block's scale to its partial sums;
  - CUDA on sm90 (Hopper, CUDA >= 12.9), more rows, K a multiple of 128: torch's blockwise
    scaled_mm on FP8 activations quantised per token and 128 columns (dynamic 1x128 scales),
    the FP8 tensor cores' product; elsewhere the weight-only product above.
The fused q/k/v and gate/up projections (integrations/fused_projections.py) are quantised as
their fused matrix (scales per output row: slicing rows slices the scales). lm_head and embeddings
stay in the model's dtype (tied to the embedding in many models, and the logits' precision).
After the engine the model keeps its FP8 layers: the original weights are gone.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from hf_paged.kernels.fp8_gemv import SCALE_BLOCK  # input columns per weight scale
from hf_paged.kernels.fp8_quant import FP8_MAX

FP8 = torch.float8_e4m3fn
QUANTIZATION_METHODS = ("fp8",)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[R, K] float32 -> [R, ceil(K / 128), 128], zero-padded along K."""
    pad = -x.shape[1] % SCALE_BLOCK
    return torch.nn.functional.pad(x, (0, pad)).view(x.shape[0], -1, SCALE_BLOCK)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight [N, K], float32 scale [N, ceil(K / 128)]) with
    weight[n, k] ~= w8[n, k] * scale[n, k // 128]. The scale is stored N-major (strides
    (1, N)): the layout the blockwise scaled_mm reads, and the GEMV's loads of one block's
    scales for consecutive rows are contiguous."""
    w = _blocks(weight.detach().float())
    scale = w.abs().amax(dim=2).clamp(min=1e-12) / FP8_MAX
    w8 = (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    w8 = w8.view(weight.shape[0], -1)[:, : weight.shape[1]].contiguous()
    return w8, _outer_major(scale)


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """[R, B] with strides (1, R), copied only when not so already (a row slice of a fused
    projection's scales)."""
    if scale.stride(0) == 1 and (scale.shape[1] == 1 or scale.stride(1) == scale.shape[0]):
        return scale
    return scale.t().contiguous().t()


def _blockwise_scaled_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # torch's 1x128 x 1x128 blockwise FP8 GEMM: Hopper with cuBLASLt >= 12.9
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(x.device)[0] != 9 or not torch.version.cuda:
        return False
    if tuple(int(v) for v in torch.version.cuda.split(".")[:2]) < (12, 9):
        return False
    return x.shape[-1] % SCALE_BLOCK == 0 and weight.shape[0] % 16 == 0


def _blockwise_scaled_mm(x, weight, scale, bias):
    import torch.nn.functional as F

    from hf_paged.kernels.fp8_quant import quantize_rows

    # dynamic activation scales, one per token and 128 columns (as the weight's blocks), M-major
    # (kernels/fp8_quant.py, one launch). cuBLASLt refused 17 rows (CUBLAS_STATUS_NOT_SUPPORTED
    # on the H200; M-major scales of a row count that is not a multiple of 4 are not 16-byte
    # aligned): zero rows pad M to a multiple of 16, the row counts the GPU test passes
    m = x.shape[0]
    x8, x_scale = quantize_rows(x, m + (-m % 16))
    block = F.ScalingType.BlockWise1x128
    out = F.scaled_mm(
        x8, weight.t(), x_scale, block, _outer_major(scale), block, output_dtype=x.dtype
    )
    out = out[:m] if out.shape[0] != m else out
    return out if bias is None else out + bias


# set by weight_only() for the thread that runs the start-up check (engines of other threads
# keep stepping as usual meanwhile)
_WEIGHT_ONLY = threading.local()


def weight_only_held() -> bool:
    return getattr(_WEIGHT_ONLY, "held", False)


@contextlib.contextmanager
def weight_only():
    """Every FP8 product of this thread weight-only while it is held: the start-up check
    (engine/verify.py) compares the paged forward with transformers' own on prompts whose row
    counts put them on different sides of MAX_ROWS (one flat batch against each prompt alone),
    so activation rounding would differ between the two for reasons that are not the
    attention's."""
    before = weight_only_held()
    _WEIGHT_ONLY.held = True
    try:
        yield
    finally:
        _WEIGHT_ONLY.held = before


def fp8_linear(x, weight, scale, bias=None):
    """x [..., K] @ dequantised(weight).T (+ bias), in x's dtype; scale [N, ceil(K / 128)]."""
    from hf_paged.kernels.fp8_gemv import MAX_ROWS, fp8_gemv_ref

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    if x.is_cuda and 1 <= rows <= MAX_ROWS:
        out = torch.ops.hf_paged.fp8_gemv(x2.contiguous(), weight, scale, bias)
    elif rows and _blockwise_scaled_mm_ok(x2, weight):
        out = torch.ops.hf_paged.fp8_scaled_mm(x2.contiguous(), weight, scale, bias)
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


@torch.library.custom_op("hf_paged::fp8_scaled_mm", mutates_args=())
def _fp8_scaled_mm_op(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # opaque to torch.compile: traced, the activations' padding and 1x128 quantisation under
    # dynamic row counts crashed inductor's tiling analysis on the H200 (torch 2.11: an
    # AssertionError in get_pw_red_splits while compiling a Llama-3-8B decoder layer). Being
    # opaque, it also reads weight_only() when it runs, not when it was traced.
    if weight_only_held():
        from hf_paged.kernels.fp8_gemv import fp8_gemv_ref

        return fp8_gemv_ref(x, weight, scale, bias)
    return _blockwise_scaled_mm(x, weight, scale, bias)


@_fp8_scaled_mm_op.register_fake
def _(x, weight, scale, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


class Fp8Linear(nn.Module):
    """Stands where an nn.Linear was: its weight in FP8 with 1x128 block scales."""

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
        layer.register_buffer("weight_scale", _outer_major(scale))  # a slice: its own copy
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
