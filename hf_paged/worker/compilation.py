"""torch.compile of the model for the engine: the whole forward, or each decoder layer.

Both keep attention as the opaque custom op `hf_paged::paged_attention` and the token dimension
dynamic, so one compilation serves every step.

- scope "model": one graph for the whole forward (embedding to logits). Inductor can fuse across
  layer boundaries, but dynamo traces and inductor lowers every layer: ~77 s for 22 layers of the
  TinyLlama-1.1B shape on the H200 host, growing with depth.
- scope "layers" (regional compilation): each decoder layer is compiled, and since all layers run
  the same code on same-shaped weights (weights are graph inputs, the layer index a CPU tensor
  buffer, attention.register_layer_indices), they share one compiled graph. Start-up is one
  layer's compile; the embedding, rotary tables, final norm and lm_head run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_paged.worker.attention import register_layer_indices, remove_layer_indices
from hf_paged.worker.graph_blockers import eager_inside_compile

SCOPES = ("model", "layers")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The stack of decoder layers: the ModuleList with num_hidden_layers entries of one class."""
    num = model.config.get_text_config().num_hidden_layers
    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) == num
            and len({type(layer) for layer in module}) == 1
        ):
            return module
    raise ValueError(
        f"compile_scope='layers': no list of {num} decoder layers found in "
        f"{type(model).__name__}; use compile_scope='model'"
    )


def compile_model(model: torch.nn.Module, scope: str) -> tuple[Callable, Callable[[], None]]:
    """Returns (the callable to run the model with, a function that undoes the compilation)."""
    if scope not in SCOPES:
        raise ValueError(f"compile_scope must be one of {SCOPES}, got {scope!r}")
    restore_experts = eager_inside_compile(model)
    if scope == "model":
        return torch.compile(model, dynamic=True, fullgraph=False), restore_experts
    layers = decoder_layers(model)
    register_layer_indices(model)
    for layer in layers:
        layer.compile(dynamic=True, fullgraph=False)

    def undo() -> None:
        for layer in layers:
            layer._compiled_call_impl = None  # what nn.Module.compile set
        remove_layer_indices(model)
        restore_experts()

    return model, undo
