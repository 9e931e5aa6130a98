"""transformers glue: switching a model's attention to hf_paged, and checking it can be."""

from __future__ import annotations

import weakref

import torch
from hf_paged.integrations.attention_adapters import (
    attention_modules,
    install_attention_adapters,
    remove_attention_adapters,
)
from hf_paged.integrations.attention_forwards import (
    forward_modules,
    forwards_refusal,
    install_attention_forwards,
    remove_attention_forwards,
)
from hf_paged.integrations.attention_refusals import refusal_reason
from hf_paged.integrations.step_positions import install_step_positions, remove_step_positions

from hf_paged.worker.attention import ATTN_IMPLEMENTATION, register

_LEASE = "_hf_paged_lease"


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
    if routes_attention(model):
        return
    reason = refusal_reason(model)
    if reason is not None:
        raise ValueError(f"model: {name}: {reason}; not supported by hf_paged")
    reason = forwards_refusal(model)  # before the lease or any module is touched
    if reason is not None:
        raise ValueError(f"model: {name}: {reason}")
    if not (attention_modules(model) or forward_modules(model)):
        raise ValueError(
            f"model: {name} does not route attention through transformers' AttentionInterface "
            "(its modelling code calls no ALL_ATTENTION_FUNCTIONS) and hf_paged has no adapter "
            "for its attention modules (integrations/attention_adapters.py, attention_forwards.py"
            "), so paged attention cannot be plugged in"
        )


def routes_attention(model: torch.nn.Module) -> bool:
    """Whether the model's attention layers call transformers' attention interface. The class
    flag _supports_attention_backend says more (that transformers' own continuous batching
    serves the model) and is False for families that do route attention (StableLM, Bart's
    decoders, BioGPT): what their code calls decides, read as transformers decides whether
    set_attn_implementation may switch them. Whether the result is exact is the start-up
    check's to say (hf_paged/engine/verify.py)."""
    if getattr(model, "_supports_attention_backend", False):
        return True
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    return bool(can_set()) if can_set is not None else False


class ModelLease:
    """Who holds a model's attention routing: every live Engine built on it. The first one in
    switches the model to paged attention (keeping what it ran before), the last one out
    switches it back and puts fused projections back, so an Engine never finds its model
    unpatched under it by another Engine's shutdown (unpatch, a second patch, a pipeline)."""

    def __init__(self, previous: str) -> None:
        self.owners: weakref.WeakSet = weakref.WeakSet()
        self.previous = previous  # the attention implementation to restore
        self.fused = False  # some owner fused q/k/v and gate/up projections
        self.lora = None  # hf_paged.lora.layers.LoraRouting: peft's LoRA layers, routed per token
        # hf_paged.quantization.fp8_checkpoints.Fp8Checkpoint: transformers' FP8 layers swapped
        self.fp8_checkpoint = None
        # hf_paged.distributed's executor: the model sharded, the other ranks' processes
        self.tp = None
        # transformers' logits for the start-up check's prompts (hf_paged/engine/verify.py),
        # taken by the first owner under `previous`: later owners must not switch the
        # attention implementation while another Engine may be stepping
        self.references: dict = {}
        # the attention modules' cores were swapped (attention_adapters.py): the model's
        # attention implementation stays what it was
        self.adapted = False


def enable_paged_attention(model: torch.nn.Module, owner: object) -> ModelLease:
    """Route the model's attention through hf_paged on behalf of `owner` (an Engine)."""
    check_supported(model)
    register()
    lease = model.__dict__.get(_LEASE)
    if lease is None or not lease.owners:
        current = model.config._attn_implementation
        if not routes_attention(model):
            lease = lease or ModelLease(current)
            model.__dict__[_LEASE] = lease
            lease.adapted = (
                install_attention_adapters(model) + install_attention_forwards(model) > 0
            )
        elif current != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if not lease_adapted(model) and model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"model: {type(model).__name__} refused attn_implementation='hf_paged'"
            )
        if lease is None:
            lease = ModelLease(current)
            model.__dict__[_LEASE] = lease
        install_step_positions(model)
    lease.owners.add(owner)
    return lease


def disable_paged_attention(model: torch.nn.Module, owner: object) -> bool:
    """`owner` gives up the model. The last owner out restores the attention implementation the
    model had and returns True (the caller then undoes what it changed on the model)."""
    lease = model.__dict__.get(_LEASE)
    if lease is None:
        return False
    lease.owners.discard(owner)
    if lease.owners:
        return False
    del model.__dict__[_LEASE]
    remove_step_positions(model)
    if lease.adapted:
        remove_attention_adapters(model)
        remove_attention_forwards(model)
    elif lease.previous != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(lease.previous)
    return True


def lease_adapted(model: torch.nn.Module) -> bool:
    lease = model.__dict__.get(_LEASE)
    return lease is not None and lease.adapted


def paged_attention_active(model: torch.nn.Module) -> bool:
    return lease_adapted(model) or model.config._attn_implementation == ATTN_IMPLEMENTATION
