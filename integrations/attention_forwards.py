"""Paged attention for families whose attention forward computes softmax attention inline.

Bloom, Falcon, MPT, XGLM, TrOCR, MVP and the BERT-style decoders (MegatronBERT, RemBERT,
RoFormer, BigBird) compute `softmax(Q K^T * scale + bias + mask) V` inside their attention
module's forward, with no method to swap (attention_adapters.py swaps those that have one).
Inside an engine step (and during the KV-shape probe) the forward here runs instead: the
module's own projections (fused or separate) and rotary embeddings, the paged attention function
with the module's scale and ALiBi slopes, the module's own output projection. Outside a step the
module's forward is transformers'. What differs between families is data (a ForwardSpec: how to
get Q/K/V, the scale, the slopes, how to return), not one forward per family. The start-up check
(hf_paged/engine/verify.py) still decides whether the result is exact.

ALiBi: the models add slope_h * key_position (Bloom; MPT relative to the last key; Falcon
scales it with the scores), the kernels slope_h * (key - query), the same softmax per row.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_paged.worker import attention as paged
from hf_paged.worker.forward_context import in_engine_step

_ORIGINAL = "_hf_paged_original_forward"


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, T, H * D] -> [B, H, T, D]"""
    return x.view(*x.shape[:2], num_heads, -1).transpose(1, 2)


def _separate_qkv(m, a):
    # Bart-style decoders that scale the query after its projection (the scale is then 1)
    h = a["hidden_states"]
    return (
        _heads(m.q_proj(h) * m.scaling, m.num_heads),
        _heads(m.k_proj(h), m.num_heads),
        _heads(m.v_proj(h), m.num_heads),
    )


def _bert_qkv(m, a):
    # BERT-style self-attention classes (query / key / value); RoFormer rotates inside it,
    # with its own rotation, the values as well under rotary_value
    h = a["hidden_states"]
    q, k, v = (_heads(proj(h), m.num_attention_heads) for proj in (m.query, m.key, m.value))
    sinusoidal = a.get("sinusoidal_pos")
    if sinusoidal is None:
        return q, k, v
    if m.rotary_value:
        return m.apply_rotary_position_embeddings(sinusoidal, q, k, v)
    return (*m.apply_rotary_position_embeddings(sinusoidal, q, k), v)


def _bloom_qkv(m, a):
    return m._reshape(m.query_key_value(a["hidden_states"]))  # [B, H, T, D] each


def _falcon_split(m, fused: torch.Tensor):
    # FalconAttention._split_heads with slices where it indexes by a list ([-2]): a list index is
    # a host tensor copied to the device, which a CUDA graph capture refuses. Same values, shapes.
    b, t, _ = fused.shape
    if m.new_decoder_architecture:
        qkv = fused.view(b, t, -1, m.num_heads // m.num_kv_heads + 2, m.head_dim)
        q, k, v = qkv[:, :, :, :-2], qkv[:, :, :, -2:-1], qkv[:, :, :, -1:]
        k, v = torch.broadcast_to(k, q.shape), torch.broadcast_to(v, q.shape)
        return tuple(x.flatten(2, 3) for x in (q, k, v))
    if not m.multi_query:
        fused = fused.view(b, t, m.num_heads, 3, m.head_dim)
        return fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
    fused = fused.view(b, t, m.num_heads + 2, m.head_dim)
    return fused[..., :-2, :], fused[..., -2:-1, :], fused[..., -1:, :]


def _falcon_qkv(m, a):
    q, k, v = _falcon_split(m, m.query_key_value(a["hidden_states"]))  # [B, T, H, D]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if a["alibi"] is None:  # rotary variant
        cos, sin = a["position_embeddings"]
        q, k = sys.modules[type(m).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _mpt_qkv(m, a):
    qkv = m.Wqkv(a["hidden_states"])
    if m.clip_qkv:
        qkv = qkv.clamp(min=-m.clip_qkv, max=m.clip_qkv)
    return tuple(_heads(x, m.n_heads) for x in qkv.chunk(3, dim=2))


def _bloom_out(m, out, a):
    # (pretraining_tp with slow_but_exact is refused at install: its split dense is not here)
    dropout_add = sys.modules[type(m).__module__].dropout_add
    return dropout_add(m.dense(out), a["residual"], m.hidden_dropout, m.training), None


def _slopes_from(build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Per-head slopes from the family's own ALiBi builder at 2 positions: [H, 1, 2] -> [H]."""
    alibi = build().float()
    alibi = alibi.reshape(-1, alibi.shape[-1])
    return alibi[:, 1] - alibi[:, 0]


def _bloom_slopes(m):
    build = sys.modules[type(m).__module__].build_alibi_tensor
    return _slopes_from(lambda: build(torch.ones(1, 2), m.num_heads, torch.float32))


def _falcon_slopes(m):
    if not m.config.alibi:
        return None
    build = sys.modules[type(m).__module__].build_alibi_tensor
    # Falcon scales its ALiBi with the scores: (q.k + alibi) / sqrt(head_dim)
    slopes = _slopes_from(lambda: build(torch.ones(1, 2), m.num_heads, torch.float32))
    return slopes * m.inv_norm_factor


def _mpt_slopes(m):
    # transformers' MPT always adds ALiBi, built with the default alibi_bias_max (8)
    build = sys.modules[type(m).__module__].build_mpt_alibi_tensor
    return _slopes_from(lambda: build(m.n_heads, 2))


@dataclass(frozen=True)
class ForwardSpec:
    """How one attention class's forward maps onto paged attention."""

    qkv: Callable  # (module, bound arguments) -> q, k, v: [B, H, T, D], rotary applied
    scale: Callable[[torch.nn.Module], float]
    output: Callable  # (module, out [B, T, H * Dv], bound arguments) -> the forward's return
    slopes: Callable[[torch.nn.Module], torch.Tensor | None] = lambda m: None
    # arguments the paged forward does not implement, refused in a step: their name, or None
    unsupported: Callable[[dict], str | None] = lambda a: None
    # a configuration of the module the paged forward does not reproduce, refused at install
    refuse: Callable[[torch.nn.Module], str | None] = lambda m: None


def _extra_keys(a: dict) -> str | None:
    # cross-attention (Bart's and BERT's names), MVP's prompt keys
    for name in ("key_value_states", "encoder_hidden_states", "attn_prompt"):
        if a.get(name) is not None:
            return name
    return None


_SEPARATE = ForwardSpec(
    _separate_qkv,
    scale=lambda m: 1.0,
    output=lambda m, out, a: (m.out_proj(out), None),
    unsupported=_extra_keys,
)
# the BERT-style classes return (context [B, T, H * D], probabilities) and scale by
# 1/sqrt(attention_head_size); causal only as decoders (the model's mask, replaced in a step)
_BERT = ForwardSpec(
    _bert_qkv,
    scale=lambda m: 1.0 / math.sqrt(m.attention_head_size),
    output=lambda m, out, a: (out, None),
    unsupported=_extra_keys,
    refuse=lambda m: (
        None
        if m.is_decoder
        else "is_decoder=False (bidirectional attention; causal only with is_decoder=True)"
    ),
)
# attention class name -> its spec; each read from transformers' modelling code
FORWARDS = {
    "MegatronBertSelfAttention": _BERT,
    "RemBertSelfAttention": _BERT,
    "RoFormerSelfAttention": _BERT,
    "BigBirdSelfAttention": _BERT,  # 'original_full'; block_sparse is refused
    "XGLMAttention": _SEPARATE,
    "TrOCRAttention": _SEPARATE,
    "MvpAttention": _SEPARATE,
    "BloomAttention": ForwardSpec(
        _bloom_qkv, scale=lambda m: m.inv_norm_factor, output=_bloom_out, slopes=_bloom_slopes
    ),
    "FalconAttention": ForwardSpec(
        _falcon_qkv,
        scale=lambda m: 1.0 / math.sqrt(m.head_dim),
        output=lambda m, out, a: (m.dense(out), None),
        slopes=_falcon_slopes,
    ),
    "MptAttention": ForwardSpec(
        _mpt_qkv,
        scale=lambda m: m.softmax_scale,
        output=lambda m, out, a: (m.out_proj(out), None),
        slopes=_mpt_slopes,
    ),
}


def _paged_forward(self, *args, **kwargs):
    spec, original, slopes = self.__dict__[_ORIGINAL]
    if not in_engine_step() and paged._recorded_shapes is None:
        return original(*args, **kwargs)
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    a = {**bound.arguments, **bound.arguments.get("kwargs", {})}
    name = spec.unsupported(a)
    if name is not None:
        raise ValueError(
            f"{type(self).__name__}: attention argument {name!r} (keys other than the step's "
            "tokens) is not supported by hf_paged"
        )
    q, k, v = spec.qkv(self, a)
    extra = {}
    if slopes is not None:
        extra["alibi_slopes"] = slopes
    out, _ = paged.paged_attention_forward(
        self, q, k, v, None, scaling=spec.scale(self), **extra
    )  # [1, T, H, Dv]
    return spec.output(self, out.flatten(2), a)


def forward_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ForwardSpec]]:
    found = []
    for m in model.modules():
        spec = FORWARDS.get(type(m).__name__)
        if spec is not None and type(m).__module__.startswith("transformers.models."):
            found.append((m, spec))
    return found


def unsupported_reason(module: torch.nn.Module, spec: ForwardSpec) -> str | None:
    """A configuration of a known class the forward here does not reproduce."""
    reason = spec.refuse(module)
    if reason is not None:
        return reason
    if getattr(module, "pretraining_tp", 1) > 1 and getattr(module, "slow_but_exact", False):
        return "pretraining_tp > 1 with slow_but_exact=True (a tensor-parallel split of dense)"
    return None


def forwards_refusal(model: torch.nn.Module) -> str | None:
    """Why the model's swappable attention modules cannot run exactly, or None: checked
    before anything on the model is changed."""
    for module, spec in forward_modules(model):
        reason = unsupported_reason(module, spec)
        if reason is not None:
            return f"{type(module).__name__}: {reason} is not supported by hf_paged"
    return None


def install_attention_forwards(model: torch.nn.Module) -> int:
    """Swap the forwards of the model's known attention modules; how many. A module without
    an int layer_idx gets its position among them, which picks its KV cache."""
    reason = forwards_refusal(model)
    if reason is not None:
        raise ValueError(reason)
    found = forward_modules(model)
    for i, (module, spec) in enumerate(found):
        if _ORIGINAL in module.__dict__:
            continue
        if not isinstance(getattr(module, "layer_idx", None), int):
            module.layer_idx = i
            module.__dict__["_hf_paged_set_layer_idx"] = True
        slopes = spec.slopes(module)
        if slopes is not None:  # on the module's device once: no copy inside a step or graph
            slopes = slopes.to(next(module.parameters()).device)
        module.__dict__[_ORIGINAL] = (spec, module.forward, slopes)
        module.forward = types.MethodType(_paged_forward, module)
    return len(found)


def remove_attention_forwards(model: torch.nn.Module) -> None:
    for module in model.modules():
        if module.__dict__.pop(_ORIGINAL, None) is None:
            continue
        module.__dict__.pop("forward", None)  # the class's forward again
        if module.__dict__.pop("_hf_paged_set_layer_idx", False):
            del module.layer_idx
