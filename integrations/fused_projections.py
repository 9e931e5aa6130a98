"""Fused projections: q/k/v into one matmul, gate/up into one, without touching the model's code.

transformers' attention and MLP forwards call `self.q_proj(x)`, `self.k_proj(x)`, `self.v_proj(x)`
(and `self.gate_proj(x)`, `self.up_proj(x)`) one after another on the same input. Each group's
weights are concatenated into one `[sum(out), in]` matrix; the group's first projection computes
the whole product and the others return their slice of it. A projection called on another input
(an architecture that does not call them in order) computes its own slice from the fused weight,
so the result is always that of the original layers; only the number of matmuls changes.

One launch instead of three (or two) per layer matters where those launches are short: decode at
small batch, where the k/v projections of a GQA model move only a few MB each.

Only plain `nn.Linear` groups (or FP8 layers an earlier engine quantised) with one input size,
dtype and device are fused; other quantised layers (bitsandbytes) are left as they are. A peft
LoRA layer counts by its base layer: the base layer is fused and the LoRA layer keeps wrapping
it (it adds its delta to the slice). A slice is an nn.Linear to peft, so an adapter loaded
later may target it. `unfuse_projections` puts the
original layout back (weights become views into the fused matrix: no extra memory).

While fused, `state_dict()` still has the original names (`...q_proj.weight`, not the fused
matrix) and `load_state_dict` takes them, so saving a patched model (save_pretrained) or loading
weights into it works as on the original.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_FUSED_PREFIX = "hf_paged_fused_"


class FusedProjection(nn.Module):
    """The concatenated weight of one group, and the product of the last input it saw.

    product_hook(fused, x, index): when set, computes each product in place of self.linear
    (index None: the whole product; else slice `index` alone, for an input out of the group's
    order). Multi-LoRA sets it (hf_paged/lora/layers.py) to add every slice's adapter deltas
    over the whole product at once."""

    product_hook = None

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.sizes = [layer.out_features for layer in linears]
        with torch.no_grad():  # inference only: the engine never trains through these
            self.weight = nn.Parameter(
                torch.cat([layer.weight for layer in linears]), requires_grad=False
            )
            biases = [layer.bias for layer in linears]
            self.bias = (
                nn.Parameter(torch.cat(biases), requires_grad=False)
                if biases[0] is not None
                else None
            )
            scales = [layer._buffers.get("weight_scale") for layer in linears]
            if scales[0] is not None:  # FP8 layers an earlier engine quantised: fused as they are
                from hf_paged.quantization.fp8_weights import _outer_major

                self.register_buffer("weight_scale", _outer_major(torch.cat(scales)))
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] | None = None

    # The fused matrix is neither saved nor loaded under its own name: each ProjectionSlice
    # saves and loads its rows under the original layer's name.
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        pass

    def _load_from_state_dict(self, *args) -> None:
        pass

    def rows(self, index: int) -> slice:
        start = sum(self.sizes[:index])
        return slice(start, start + self.sizes[index])

    def linear(self, x: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[rows]
        scale = self._buffers.get("weight_scale")
        if scale is not None:  # FP8 weights (quantization="fp8"): scales per row and 128 columns
            from hf_paged.quantization.fp8_weights import fp8_linear

            return fp8_linear(x, self.weight[rows], scale[rows], bias)
        return F.linear(x, self.weight[rows], bias)

    def _product(self, x: torch.Tensor, index: int | None) -> torch.Tensor:
        hook = self.product_hook  # an instance attribute: a plain function, not bound
        if hook is not None:
            return hook(self, x, index)
        return self.linear(x, slice(None) if index is None else self.rows(index))

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            self._parts = self._product(x, None).split(self.sizes, dim=-1)
            self._input = x
        elif self._input is not x:  # not the group's usual call order: compute this slice only
            return self._product(x, index)
        out = self._parts[index]
        if index == len(self.sizes) - 1:  # last of the group: hold no activations between calls
            self._input = self._parts = None
        return out


class ProjectionSlice(nn.Linear):
    """Stands where one of the group's nn.Linear was; weight/bias are views of the fused ones.
    An nn.Linear by type (peft wraps only those) that owns no parameters of its own."""

    def __init__(self, fused: FusedProjection, index: int, original: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: weight and bias are the fused matrix's rows
        object.__setattr__(self, "fused", fused)  # not a submodule: its weight is stored once
        self.index = index
        self.in_features = original.in_features
        self.out_features = original.out_features
        self.requires_grad = original.weight.requires_grad  # restored by unfuse_projections

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self.fused.rows(self.index)]

    @property
    def bias(self) -> torch.Tensor | None:
        b = self.fused.bias
        return None if b is None else b[self.fused.rows(self.index)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        # Copies, not views: safetensors (save_pretrained) refuses tensors sharing one storage.
        # The copies live only as long as the caller's state dict.
        for name in ("weight", "bias"):
            value = getattr(self, name)
            if value is not None:
                destination[prefix + name] = value if keep_vars else value.detach().clone()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ) -> None:
        for name in ("weight", "bias"):
            target, key = getattr(self, name), prefix + name
            if target is None:
                continue
            if key not in state_dict:
                missing.append(key)
                continue
            value = state_dict[key]
            if value.shape != target.shape:
                errors.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                    f"the shape in current model is {tuple(target.shape)}."
                )
                continue
            with torch.no_grad():
                target.copy_(value)  # a view of the fused matrix: writes through


def lora_base(layer):
    """A peft LoRA layer's base layer (the layer itself when it is not one): duck-typed, so
    this module needs no peft."""
    base = getattr(layer, "base_layer", None)
    return base if base is not None and hasattr(layer, "lora_A") else layer


def _fusable(layers: list) -> bool:
    from hf_paged.quantization.fp8_weights import Fp8Linear

    layers = [lora_base(layer) for layer in layers]
    kinds = {type(layer) for layer in layers}
    # plain linears, or the FP8 layers an earlier engine left (quantization="fp8")
    if len(kinds) != 1 or not kinds <= {nn.Linear, Fp8Linear}:
        return False
    first = layers[0]
    return all(
        layer.in_features == first.in_features
        and layer.weight.dtype == first.weight.dtype
        and layer.weight.device == first.weight.device
        and (layer.bias is None) == (first.bias is None)
        for layer in layers
    )


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of plain linear layers; returns how many groups."""
    count = 0
    for module in list(model.modules()):
        for names in GROUPS:
            layers = [getattr(module, name, None) for name in names]
            if any(layer is None for layer in layers) or not _fusable(layers):
                continue
            fused = FusedProjection([lora_base(layer) for layer in layers])
            setattr(module, _FUSED_PREFIX + "_".join(names), fused)
            for index, (name, layer) in enumerate(zip(names, layers)):
                base = lora_base(layer)
                holder, attr = (module, name) if base is layer else (layer, "base_layer")
                setattr(holder, attr, ProjectionSlice(fused, index, base))
            count += 1
    return count


def unfuse_projections(model: nn.Module) -> int:
    """Put nn.Linear layers back (their weights views of the fused matrix); returns groups."""
    count = 0
    for module in list(model.modules()):
        for names in GROUPS:
            key = _FUSED_PREFIX + "_".join(names)
            fused = getattr(module, key, None)
            if fused is None:
                continue
            scale = fused._buffers.get("weight_scale")
            for index, name in enumerate(names):
                wrapper = getattr(module, name)
                part: ProjectionSlice = lora_base(wrapper)
                # a LoRA layer (peft's, maybe added while fused) keeps wrapping the base layer
                holder, attr = (module, name) if part is wrapper else (wrapper, "base_layer")
                if scale is not None:  # quantised while fused: FP8 layers of their rows
                    from hf_paged.quantization.fp8_weights import Fp8Linear

                    rows = fused.rows(index)
                    setattr(holder, attr, Fp8Linear.of(part.weight, scale[rows], part.bias))
                    continue
                layer = nn.Linear(
                    part.in_features,
                    part.out_features,
                    bias=fused.bias is not None,
                    device="meta",
                )
                layer.weight = nn.Parameter(part.weight, requires_grad=part.requires_grad)
                if fused.bias is not None:
                    layer.bias = nn.Parameter(part.bias, requires_grad=part.requires_grad)
                setattr(holder, attr, layer)
            delattr(module, key)
            count += 1
    return count
