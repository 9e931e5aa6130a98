"""transformers glue: switching a model's attention to hf_paged, and checking it can be."""

from __future__ import annotations

import torch

from hf_paged.attention import ATTN_IMPLEMENTATION, register

_PREV_ATTN = "_hf_paged_prev_attn_implementation"


def check_supported(model: torch.nn.Module) -> None:
    """Refuse models whose attention does not go through transformers' AttentionInterface."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"model: {name} is not a transformers PreTrainedModel")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model: {name} is an encoder-decoder; hf_paged serves decoder-only models"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"model: {name} does not route attention through transformers' AttentionInterface "
            "(its _supports_attention_backend is False), so paged attention cannot be plugged in"
        )


def enable_paged_attention(model: torch.nn.Module) -> None:
    check_supported(model)
    register()
    current = model.config._attn_implementation
    if current != ATTN_IMPLEMENTATION:
        setattr(model, _PREV_ATTN, current)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"model: {type(model).__name__} refused attn_implementation='hf_paged'")


def disable_paged_attention(model: torch.nn.Module) -> None:
    prev = getattr(model, _PREV_ATTN, None)
    if prev is not None:
        model.set_attn_implementation(prev)
        delattr(model, _PREV_ATTN)
