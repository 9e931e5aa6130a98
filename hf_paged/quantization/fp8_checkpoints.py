"""FP8 checkpoints as transformers loads them (`FineGrainedFP8Config`: transformers' FP8Linear,
float8_e4m3fn weights with float32 or power-of-two scales per [block_n, block_k] block, or one
per tensor) run on hf_paged's FP8 kernels while an engine holds the model.

Transformers runs FP8Linear with kernels it fetches from the hub (`kernels`, DeepGEMM), which an
offline machine cannot. Its layout converts to Fp8Linear's (one scale per output row and 128
input columns, quantization/fp8_weights.py) without touching a weight byte: every row of a
[block_n, block_k] block takes the block's scale, repeated over block_k / 128 column blocks, so
the dequantised weights are the same. The FP8 weight tensor is shared, not copied; the scales
grow from [N / block_n, K / block_k] to [N, K / 128] floats (1/32 of the weight's bytes).

What changes is the activations' side: transformers quantises them to FP8 (per token and 128
columns, or with a static scale) at every row count; the engine multiplies steps of up to 16
rows weight-only and quantises larger ones per token and 128 columns, as for
`quantization="fp8"`. So tokens can differ from transformers' own FP8 forward, as they can
between two batch sizes there.

Layers the layout cannot express exactly stay transformers' own: FP4-packed weights, block_k
not a multiple of 128, weights transformers left unquantised (shapes its blocks do not divide).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.kernels.fp8_gemv import SCALE_BLOCK
from hf_paged.quantization.fp8_weights import Fp8Linear, _outer_major


def _is_transformers_fp8(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "FP8Linear" and cls.__module__.startswith("transformers")


def row_block_scales(module: nn.Module) -> torch.Tensor | None:
    """float32 [N, ceil(K / 128)] (N-major) scales equal to the layer's own, or None where its
    layout has no such form."""
    weight = module.weight
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        return None
    n, k = weight.shape
    blocks = -(-k // SCALE_BLOCK)
    scale = module.weight_scale_inv.detach().to(torch.float32)  # e8m0 powers of two: exact
    block = getattr(module, "block_size", None)
    if block is None or scale.numel() == 1:  # one scale for the tensor
        return _outer_major(scale.reshape(1, 1).expand(n, blocks).contiguous())
    block_n, block_k = block
    if block_k % SCALE_BLOCK or scale.shape != (-(-n // block_n), -(-k // block_k)):
        return None
    rows = scale.repeat_interleave(block_n, dim=0)[:n]
    return _outer_major(rows.repeat_interleave(block_k // SCALE_BLOCK, dim=1)[:, :blocks])


class Fp8Checkpoint:
    """The model's transformers FP8Linear layers replaced by Fp8Linear views of the same
    weights for as long as an engine holds the model (integrations/transformers.ModelLease);
    close() puts the very same layer objects back, holding the same weight values."""

    def __init__(self, model: nn.Module) -> None:
        self._swapped: list[tuple[nn.Module, str, nn.Module]] = []
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if not _is_transformers_fp8(child):
                    continue
                scale = row_block_scales(child)
                if scale is None:
                    continue
                bias = None if child.bias is None else child.bias.detach()
                setattr(parent, name, Fp8Linear.of(child.weight.detach(), scale, bias))
                # the layer set aside lets go of its weight: fused projections copy the weights
                # into one matrix, and two copies would double the model's FP8 bytes
                child._parameters["weight"] = None
                self._swapped.append((parent, name, child))

    def __len__(self) -> int:
        return len(self._swapped)

    def close(self) -> None:
        """Each layer back with the weight its stand-in holds now (after unfusing, rows of the
        fused matrix: the same values)."""
        for parent, name, layer in reversed(self._swapped):
            standing = getattr(parent, name)
            layer.weight = nn.Parameter(standing.weight.detach(), requires_grad=False)
            setattr(parent, name, layer)
        self._swapped.clear()
