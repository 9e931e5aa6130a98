"""Paged attention for model families whose attention does not call transformers' interface.

Older families (GPT-Neo, OpenAI-GPT, GPT-NeoX-Japanese) compute attention in a method of their
attention module, `softmax(Q K^T * scale + mask) V` over [batch, heads, tokens, head_dim]
tensors, after their own projections and rotary embeddings. Inside an engine step (and during
the KV-shape probe) that one method is replaced by the paged attention function, with the
module's scale and window; everything around it runs as transformers wrote it, and outside
engine steps the method is the model's own. One parametrised core serves every family: what
differs is read from a CoreSpec (where the method is, the key layout, the scale, the window,
what the method returns). The start-up check (hf_paged/engine/verify.py) still decides whether
the result is exact.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_paged.worker import attention as paged
from hf_paged.worker.forward_context import in_engine_step

_ORIGINAL = "_hf_paged_original_core"
_OWN_LAYER_IDX = "_hf_paged_set_layer_idx"


@dataclass(frozen=True)
class CoreSpec:
    """How one attention class computes softmax(Q K^T * scale + mask) V."""

    method: str  # the method taking (query, key, value, attention_mask, ...)
    scale: Callable[[torch.nn.Module, torch.Tensor], float]  # (module, value) -> scale
    keys_transposed: bool = False  # key passed as [B, H, D, T] (OpenAI-GPT)
    window: Callable[[torch.nn.Module], int] = lambda module: 0  # 0: none; else q - k < window
    as_list: bool = False  # returns [output] rather than (output, weights)


# attention class name -> its core. Each was read from transformers' modelling code: a
# class here computes exactly the standard softmax attention in `method`, causal by a buffer
# mask (which the block tables replace) plus the additive padding mask (none in a step).
CORES = {
    # scores unscaled; "local" layers see the last window_size keys
    "GPTNeoSelfAttention": CoreSpec(
        "_attn",
        scale=lambda m, v: 1.0,
        window=lambda m: m.config.window_size if m.attention_type == "local" else 0,
    ),
    # scale is a flag: 1/sqrt(head_dim) or none
    "Attention": CoreSpec(
        "_attn",
        scale=lambda m, v: v.shape[-1] ** -0.5 if m.scale else 1.0,
        keys_transposed=True,
        as_list=True,
    ),
    "GPTNeoXJapaneseAttention": CoreSpec("_attn", scale=lambda m, v: 1.0 / m.norm_factor),
}
# module whose "Attention" class is OpenAI-GPT's (a name that generic needs its module too)
_MODULE_OF = {"Attention": "transformers.models.openai.modeling_openai"}


def _spec_for(module: torch.nn.Module) -> CoreSpec | None:
    cls = type(module)
    spec = CORES.get(cls.__name__)
    if spec is None or _MODULE_OF.get(cls.__name__, cls.__module__) != cls.__module__:
        return None
    return spec if callable(getattr(module, spec.method, None)) else None


def _paged_core(self, query, key, value, attention_mask=None, *args, **kwargs):
    spec, original = self.__dict__[_ORIGINAL]
    if not in_engine_step() and paged._recorded_shapes is None:
        return original(query, key, value, attention_mask, *args, **kwargs)
    if spec.keys_transposed:
        key = key.transpose(-1, -2)
    out, _ = paged.paged_attention_forward(
        self,
        query,
        key,
        value,
        None,  # the block tables are the mask in a step
        scaling=spec.scale(self, value),
        sliding_window=spec.window(self) or None,
    )
    out = out.transpose(1, 2)  # [1, T, H, D] -> [1, H, T, D], as the method returns it
    return [out] if spec.as_list else (out, None)


def attention_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, CoreSpec]]:
    return [(m, s) for m in model.modules() if (s := _spec_for(m)) is not None]


def install_attention_adapters(model: torch.nn.Module) -> int:
    """Route the cores of the model's known attention modules to paged attention; how many.
    A module without an int layer_idx gets its position among them (GPT-Neo's layer_id,
    OpenAI-GPT's none), which picks its KV cache."""
    found = attention_modules(model)
    for i, (module, spec) in enumerate(found):
        if _ORIGINAL in module.__dict__:
            continue
        if not isinstance(getattr(module, "layer_idx", None), int):
            module.layer_idx = i
            module.__dict__[_OWN_LAYER_IDX] = True
        module.__dict__[_ORIGINAL] = (spec, getattr(module, spec.method))
        setattr(module, spec.method, types.MethodType(_paged_core, module))
    return len(found)


def remove_attention_adapters(model: torch.nn.Module) -> None:
    for module in model.modules():
        entry = module.__dict__.pop(_ORIGINAL, None)
        if entry is None:
            continue
        module.__dict__.pop(entry[0].method, None)  # the class's method again
        if module.__dict__.pop(_OWN_LAYER_IDX, False):
            del module.layer_idx
