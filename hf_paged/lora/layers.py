"""Per-token LoRA on peft's own layers: each LoRA Linear of a PeftModel computes
base_layer(x) + B_a(A_a(x)) * scaling_a for the tokens of the requests that chose adapter a.

peft's mixed-batch forward (`adapter_names=`) splits a padded batch by rows; the engine's batch is
one flat row of tokens from many requests, so the split is by token: the runner puts each
adapter's token indices in the forward context, and every LoRA layer gathers those tokens, applies
the adapter and adds the result back, with peft's arithmetic (so a request's tokens are the ones
peft gives with that adapter alone). The base weights and the adapters stay where peft keeps them:
adapters loaded with `load_adapter` after the engine started are usable at once.

Outside an engine step (a plain forward of the model) the layer runs peft's own forward.
"""

from __future__ import annotations

import types
import warnings

import torch

from hf_paged.worker.forward_context import get_forward_context, in_engine_step

_ORIGINAL = "_hf_paged_peft_forward"


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's LoRA layers of the model, by module name (none for a model without peft)."""
    try:
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:
        return {}
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


def _paged_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if not in_engine_step() or self.disable_adapters or self.merged:
        return self.__dict__[_ORIGINAL](x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    groups = get_forward_context().lora_groups
    if not groups:
        return result
    dtype = result.dtype
    for name, index in groups:
        if name not in self.lora_A:  # this adapter does not target this layer
            continue
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        # x: [1, T, in], the step's flat batch; dropout is off in eval, as in peft's inference
        sub = x.index_select(-2, index).to(lora_a.weight.dtype)
        delta = lora_b(lora_a(sub)) * self.scaling[name]
        result = result.index_add(-2, index, delta.to(dtype))
    return result


def restrict_config(config) -> list[str]:
    """The per-token path gathers each adapter's tokens by data-dependent indices, which a CUDA
    graph cannot replay and the small-batch forward (its own fused weights) does not apply: with
    LoRA layers the engine runs without them (and without torch.compile). Returns what it turned
    off."""
    off = []
    if config.cuda_graphs:
        config.cuda_graphs = False
        off.append("cuda_graphs")
    if config.compile:
        config.compile = False
        off.append("compile")
    if config.small_batch_rows:
        config.small_batch_rows = 0
        off.append("small_batch_rows")
    return off


def adapter_names(model: torch.nn.Module) -> set[str]:
    """The LoRA adapters a PeftModel has now (peft_config keys; load_adapter adds to them)."""
    return set(getattr(model, "peft_config", {}) or {})


class LoraRouting:
    """The model's LoRA layers routed per token while an engine holds the model. Adapters added
    after start-up (peft's load_adapter / add_adapter) may bring new LoRA layers: the first
    request that names an adapter not seen before routes them (before it is admitted, so no
    step runs that adapter's tokens through an unrouted layer; an unrouted layer computes the
    base output for every other adapter, as it holds none of their weights)."""

    def __init__(self, model: torch.nn.Module, layers: dict[str, torch.nn.Module]) -> None:
        self.model = model
        self.layers = dict(layers)
        self._seen = adapter_names(model)
        install(self.layers)

    def adapters(self) -> set[str]:
        names = adapter_names(self.model)
        if names - self._seen:
            found = lora_layers(self.model)
            new = {k: v for k, v in found.items() if k not in self.layers}
            check_supported(self.model, found)
            install(new)
            self.layers.update(new)
            self._seen = names
        return names

    def close(self) -> None:
        uninstall(self.layers)


def route_adapters(model: torch.nn.Module, config, lease) -> LoraRouting | None:
    """An Engine starting on the model: if it has LoRA layers, check them, fit the options to
    the per-token path (warning when that turns something off on a GPU) and route the layers,
    once per model (lease: the model's ModelLease; its last owner puts the layers back)."""
    layers = lora_layers(model)
    if not layers:
        return None
    check_supported(model, layers)
    off = restrict_config(config)
    if off and next(model.parameters()).is_cuda:  # (off the GPU they never run)
        warnings.warn(
            f"hf_paged: LoRA adapters run without {', '.join(off)} for now",
            RuntimeWarning,
            stacklevel=5,
        )
    if lease.lora is None:
        lease.lora = LoraRouting(model, layers)
    return lease.lora
