"""Per-token LoRA on peft's own layers: each LoRA Linear of a PeftModel computes
base_layer(x) + B_a(A_a(x)) * scaling_a for every token, a being the adapter of that token's
request.

peft's mixed-batch forward (`adapter_names=`) splits a padded batch by rows; the engine's batch is
one flat row of tokens from many requests, so the split is by token: the runner puts each token's
adapter slot in the forward context (hf_paged.lora.batch.LoraBatch), and every LoRA layer adds
x @ A[slot]^T @ B[slot]^T * scale[slot] from its stacked buffers (hf_paged.lora.slots) through
one custom op: the Triton shrink/expand kernels on CUDA (kernels/lora.py), their torch refs
elsewhere. The op's shapes depend on the token count only, and torch.compile sees one opaque call
(no data-dependent gather, no graph break), so the LoRA path runs compiled. The base weights'
values are never touched; peft keeps its adapters, the slots hold copies.

A fused projection's slices (q/k/v, gate/up: integrations/fused_projections.py) take their deltas
together: the FusedProjection's product hook (group_product) runs one shrink over the group's
stacked A and one expand over its whole product (group_add_), so a decoder layer makes 4 LoRA
ops instead of 7, and no op writes into a strided column slice; the slices' LoRA layers then
return the slice as it is. Where a projection's weight has its slots' A rows appended
(hf_paged/lora/fold.py), its GEMM does the shrink and only the expand runs (fold.product).

Outside an engine step (a plain forward of the model) the layer runs peft's own forward.
"""

from __future__ import annotations

import sys
import types

import torch

from hf_paged.lora import fold
from hf_paged.lora.slots import (
    GROUP_A,
    GROUP_B,
    GROUP_SCALE,
    SCALE,
    WRAPPERS,
    A,
    B,
    projection_slice,
)
from hf_paged.worker.forward_context import get_forward_context, in_engine_step

_ORIGINAL = "_hf_paged_peft_forward"


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's LoRA layers of the model, by module name (none for a model without peft)."""
    # A LoRA layer exists only once its module is imported: a process that never imported it
    # has none, and skips the import (peft pulls in bitsandbytes and inductor: 2.2 s of an
    # Engine's start-up on a CPU host, measured 2026-12-02)
    if "peft.tuners.lora.layer" not in sys.modules:
        return {}
    from peft.tuners.lora.layer import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def check_supported(model: torch.nn.Module, layers: dict[str, torch.nn.Module]) -> None:
    """Refuse what the per-token path does not compute exactly, naming the adapter and layer."""
    from peft.tuners.lora.layer import Linear

    output = model.get_output_embeddings()
    for name, layer in layers.items():
        if not isinstance(layer, Linear):
            raise ValueError(
                f"model: LoRA on {name} ({type(layer).__name__}) is not supported; hf_paged "
                "applies LoRA to Linear layers only (not embeddings or convolutions)"
            )
        if layer.base_layer is output or layer is output or name.endswith("lm_head"):
            raise ValueError(
                f"model: a LoRA adapter on the output layer ({name}) is not supported (the engine "
                "computes logits for sampled rows only)"
            )
        biased = [a for a, on in (getattr(layer, "lora_bias", {}) or {}).items() if on]
        if biased:
            raise ValueError(
                f"model: adapter(s) {sorted(biased)} on {name} have a bias in lora_B "
                "(lora_bias=True); hf_paged supports plain LoRA"
            )
        variants = getattr(layer, "lora_variant", {}) or {}
        dora = [a for a, on in (getattr(layer, "use_dora", {}) or {}).items() if on]
        if variants or dora:
            raise ValueError(
                f"model: adapter(s) {sorted(set(variants) | set(dora))} on {name} use a LoRA "
                "variant (DoRA, aLoRA, ...); hf_paged supports plain LoRA"
            )


def install(layers: dict[str, torch.nn.Module]) -> None:
    """Route each layer's forward through the per-token path (idempotent)."""
    for layer in layers.values():
        if _ORIGINAL not in layer.__dict__:
            layer.__dict__[_ORIGINAL] = layer.forward
            layer.forward = types.MethodType(_paged_lora_forward, layer)


def uninstall(layers: dict[str, torch.nn.Module]) -> None:
    for layer in layers.values():
        original = layer.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            del layer.forward  # the instance attribute: the class's forward again
            if getattr(layer.forward, "__func__", None) is not getattr(original, "__func__", None):
                layer.forward = original


def live(layer: torch.nn.Module) -> bool:
    """A routed LoRA layer (it holds slot buffers) whose deltas apply in engine steps."""
    return getattr(layer, A, None) is not None and not (layer.disable_adapters or layer.merged)


def grouped(fused: torch.nn.Module) -> bool:
    """Whether a FusedProjection adds its slices' deltas itself: it holds group buffers and
    every routed LoRA layer of its slices is live (a layer disabled or merged on its own, which
    peft's own calls never do, leaves each live layer to add its delta alone)."""
    # plain branches: the H200 host's dynamo (Python 3.12) does not trace the builtin bool() of
    # a dict's values or of a list; it broke each compiled decoder layer into 17 graphs there,
    # with nothing fused across them
    wrappers = fused.__dict__.get(WRAPPERS)
    if not wrappers:
        return False
    for wrapper in wrappers.values():
        if not live(wrapper):
            return False
    return True


def group_product(fused, x: torch.Tensor, index: int | None) -> torch.Tensor:
    """FusedProjection's product hook: its product of x (index None: the whole group's; else
    slice `index` alone) plus, in an engine step, the LoRA deltas of the step's tokens."""
    rows = slice(None) if index is None else fused.rows(index)
    if not in_engine_step() or not grouped(fused):
        return fused.linear(x, rows)
    if index is None:
        buffers = fused._buffers
        sizes = list(fused.sizes)
        if fold.folded(fused):  # the shrink is in the GEMM (hf_paged/lora/fold.py)
            return fold.product(fused, x, buffers[GROUP_B], buffers[GROUP_SCALE], sizes)
        y = fused.linear(x)
        group_add_(y, x, buffers[GROUP_A], buffers[GROUP_B], buffers[GROUP_SCALE], sizes)
        return y
    y = fused.linear(x, rows)
    wrapper = fused.__dict__[WRAPPERS].get(index)  # inputs not in the group's order
    if wrapper is not None:
        lora_add_(y, x, getattr(wrapper, A), getattr(wrapper, B), getattr(wrapper, SCALE))
    return y


def _paged_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if not in_engine_step() or self.disable_adapters or self.merged:
        return self.__dict__[_ORIGINAL](x, *args, **kwargs)
    part = projection_slice(self)
    if part is not None and grouped(part.fused):  # the fused product has this slice's delta
        return self.base_layer(x, *args, **kwargs)
    base = self.base_layer
    if fold.folded(base):  # the shrink is in the GEMM (hf_paged/lora/fold.py)
        scale = getattr(self, SCALE)[None]
        return fold.product(base, x, getattr(self, B), scale, [base.out_features])
    result = base(x, *args, **kwargs)
    lora_add_(result, x, getattr(self, A), getattr(self, B), getattr(self, SCALE))
    return result


def _add(y, x, a, b, scale, slices: list[int] | None) -> None:
    """The ops' body: y += the step's per-token deltas (slices: y's column slices, each with
    its own R columns of the shrink and its own scale row)."""
    ctx = get_forward_context()
    batch = ctx.lora_groups if ctx is not None else None
    if batch is None:
        return
    flat_y = y.view(-1, y.shape[-1]) if y.is_contiguous() else y.reshape(-1, y.shape[-1])
    flat_x = x.reshape(-1, x.shape[-1])
    if fold.use_kernels(y):
        from hf_paged.kernels.lora import lora_expand, lora_shrink

        segments = (batch.sorted_tokens, batch.slot_start)
        s = lora_shrink(flat_x, a, *segments)
        lora_expand(flat_y, s, b, scale, *segments, slices=slices)
    else:
        from hf_paged.kernels.lora import lora_expand_ref, lora_shrink_ref

        slots = batch.token_slots
        s = lora_shrink_ref(flat_x, a, slots)
        flat_y.copy_(lora_expand_ref(flat_y, s, b, scale, slots, slices=slices))
    # reshape copies only where y's rows cannot be viewed flat; a column slice of a fused
    # projection's output (strided rows) is viewed as it is and written in place
    if flat_y.data_ptr() != y.data_ptr():
        y.copy_(flat_y.view(y.shape))


@torch.library.custom_op("hf_paged::lora_add_", mutates_args=("y",))
def lora_add_(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor
) -> None:
    """y += x @ A[slot]^T @ B[slot]^T * scale[slot] for each token of the step with an adapter
    (the forward context's LoRA batch; none: nothing to add). y [..., T, out], x [..., T, in]."""
    _add(y, x, a, b, scale, None)


@lora_add_.register_fake
def _(y, x, a, b, scale) -> None:
    return None


@torch.library.custom_op("hf_paged::lora_group_add_", mutates_args=("y",))
def group_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    slices: list[int],
) -> None:
    """lora_add_ for a fused projection's whole product y [..., T, sum(slices)]: one shrink over
    the group's A [S, len(slices) * R, in], one expand whose column slice i reads its own R
    columns of the shrink and scale[i] ([len(slices), S])."""
    _add(y, x, a, b, scale, slices)


@group_add_.register_fake
def _(y, x, a, b, scale, slices) -> None:
    return None


def adapter_names(model: torch.nn.Module) -> set[str]:
    """The LoRA adapters a PeftModel has now (peft_config keys; load_adapter adds to them)."""
    return set(getattr(model, "peft_config", {}) or {})


def active_adapter(model: torch.nn.Module) -> str | None:
    """The adapter peft's own forward would apply now: a PeftModel's one active LoRA adapter,
    unless its adapters are disabled (peft's disable_adapter()); None otherwise."""
    if not adapter_names(model):
        return None
    active = getattr(model, "active_adapters", None)
    if not isinstance(active, list) or len(active) != 1 or active[0] not in adapter_names(model):
        return None
    layer = next(iter(lora_layers(model).values()), None)
    if layer is None or layer.disable_adapters:
        return None
    return active[0]
