"""patch(model) / unpatch(model): put a model's generate on the engine, and take it back."""

from __future__ import annotations

import types

import torch

from hf_paged.engine import Engine
from hf_paged.generation.generate import paged_generate

ENGINE_ATTR = "_hf_paged_engine"


def patch(model: torch.nn.Module, tokenizer=None, **options) -> torch.nn.Module:
    """Swap the model's attention for paged attention and its generate for the engine's.
    Options are Engine options (block_size, num_blocks, max_num_batched_tokens, ...).
    Patching an already patched model rebuilds the engine with the new options."""
    if getattr(model, ENGINE_ATTR, None) is not None:
        unpatch(model)
    engine = Engine(model, tokenizer, **options)
    setattr(model, ENGINE_ATTR, engine)
    model.generate = types.MethodType(paged_generate, model)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Shut the patched engine down and give the model its own generate back. Its attention
    goes back to what it was once no other live Engine runs on it."""
    if getattr(model, ENGINE_ATTR, None) is None:
        raise ValueError("model: this model is not patched by hf_paged")
    getattr(model, ENGINE_ATTR).shutdown()
    delattr(model, ENGINE_ATTR)
    if "generate" in model.__dict__:
        del model.generate
    return model


def get_engine(model: torch.nn.Module) -> Engine:
    engine = getattr(model, ENGINE_ATTR, None)
    if engine is None:
        raise ValueError("model: this model is not patched by hf_paged")
    return engine
