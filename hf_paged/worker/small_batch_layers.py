"""Which models the small-batch forward (small_batch_forward.py) runs, and their layers' parts.

Every family it takes is a stack of pre-norm decoder layers with RoPE (rotate_half), paged
attention and a gated MLP; they differ in where a norm sits and how it rounds, and in a few
scalars. Each difference is named here, read from the model's own modules, so that the forward
computes what transformers' modules compute:

- llama / mistral / qwen2: the base structure (qwen2: q/k/v biases; mistral: the config's
  sliding window on every layer).
- qwen3: q_norm / k_norm, RMSNorms over each query / key head before RoPE.
- phi3: the checkpoint's own fused qkv_proj and gate_up_proj ([gate | up] rows); the config's
  sliding window on every layer.
- gemma2: embedding times sqrt(hidden) (the embedding module's scale, in the model dtype);
  RMSNorms with (1 + weight), rounded once; sandwich norms (the attention and MLP outputs
  normalised before the residual add); GELU(tanh) gate; attention logits soft-capped and scaled
  by query_pre_attn_scalar; alternating sliding-window layers; final logits soft-capped.

FP8 layers (quantization="fp8") are taken as they are: the GEMVs dequantise their blocks. Anything
else (partial rotary, a PeftModel on phi3's fused projections, bitsandbytes layers, FP8 on
phi3's own fused projections) is refused by unsupported_reason, and the model runs transformers'
forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_paged.worker.compilation import decoder_layers

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2")
# the config's sliding window, passed by the attention module to every layer
_CONFIG_WINDOW = ("mistral", "phi3")
# activation name in the config -> fused_gemv's activation
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def transformers_model(model: nn.Module) -> nn.Module:
    """A PeftModel's transformers model (its LoRA layers stay in place), else the model."""
    get = getattr(model, "get_base_model", None)
    return get() if hasattr(model, "peft_config") and get is not None else model


def _activation_name(cfg) -> str | None:
    if cfg.model_type == "gemma2":  # Gemma 2's MLP reads hidden_activation
        return getattr(cfg, "hidden_activation", None)
    return getattr(cfg, "hidden_act", None)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def is_rms_norm(module, plus_one: bool = False) -> bool:
    """An RMSNorm module as the kernels compute it: LlamaRMSNorm's rounding (variance_epsilon),
    or with plus_one Gemma2RMSNorm's (eps)."""
    eps = "eps" if plus_one else "variance_epsilon"
    return (
        module is not None
        and type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and hasattr(module, eps)
    )


def norm_eps(module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    return float(module.eps if eps is None else eps)


def unsupported_reason(model: nn.Module) -> str | None:
    """None if SmallBatchForward can run this model, else why not (fused q/k/v and gate/up
    projections are required: Engine(fuse_projections=True), the default)."""
    peft = hasattr(model, "peft_config")
    model = transformers_model(model)
    cfg = model.config.get_text_config()
    family = cfg.model_type
    if family not in ARCHITECTURES:
        return f"model_type {family!r} is not one of {ARCHITECTURES}"
    act = _activation_name(cfg)
    want = "gelu_pytorch_tanh" if family == "gemma2" else "silu"
    if act != want:
        return f"activation {act!r} is not {want!r}"
    if family == "phi3" and peft:
        return "LoRA on phi3's fused qkv_proj / gate_up_proj"
    try:
        layers = decoder_layers(model)
    except ValueError as exc:
        return str(exc)
    base = getattr(model, "model", None)
    lm_head = getattr(model, "lm_head", None)
    if base is None or type(lm_head) is not nn.Linear or lm_head.bias is not None:
        return "no base model, or lm_head is not a plain bias-free nn.Linear"
    reason = _embedding_reason(getattr(base, "embed_tokens", None), family)
    if reason is not None:
        return reason
    plus_one = family == "gemma2"
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or not is_rms_norm(getattr(base, "norm", None), plus_one):
        return "no rotary_emb or final RMSNorm"
    head_dim = _head_dim(cfg)
    if head_dim % 2:
        return f"head_dim {head_dim} is odd"
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or 2 * inv_freq.numel() != head_dim:
        return "partial rotary (RoPE over part of each head)"
    from hf_paged.kernels.gemv_tiles import tile_config

    for k, gated in ((cfg.hidden_size, True), (cfg.intermediate_size, False)):
        if tile_config(k, gated) is None:
            return f"in_features {k}: a GEMV weight row does not fit in registers"
    for layer in layers:
        reason = _layer_reason(layer, family, head_dim)
        if reason is not None:
            return reason
    return None


def _embedding_reason(embed, family: str) -> str | None:
    if family == "gemma2":  # Gemma2TextScaledWordEmbedding: rows times its embed_scale
        if not isinstance(getattr(embed, "embed_scale", None), torch.Tensor):
            return "embed_tokens without embed_scale"
    elif type(embed) is not nn.Embedding:
        return "embed_tokens is not an nn.Embedding"
    if embed.weight.stride(-1) != 1:  # kernels/embedding.py reads whole rows
        return "embed_tokens.weight rows are not contiguous"
    return None


_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
_GEMMA_NORMS = _LAYER_NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _layer_reason(layer: nn.Module, family: str, head_dim: int) -> str | None:
    from hf_paged.integrations.fused_projections import ProjectionSlice, lora_base

    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return "a decoder layer without self_attn / mlp"
    plus_one = family == "gemma2"
    names = _GEMMA_NORMS if plus_one else _LAYER_NORMS
    if not all(is_rms_norm(getattr(layer, n, None), plus_one) for n in names):
        return "a decoder layer whose norms are not RMSNorm"
    if family == "qwen3":
        norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
        if not all(is_rms_norm(n) and n.weight.shape == (head_dim,) for n in norms):
            return "q_norm / k_norm are not RMSNorms over head_dim"
    if family == "phi3":
        qkv, gate_up = getattr(attn, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)
        if type(qkv) is not nn.Linear or type(gate_up) is not nn.Linear:
            return "qkv_proj / gate_up_proj are not plain nn.Linear (quantised)"
        if gate_up.bias is not None:
            return "gate/up projections with bias"
    else:
        parts = [lora_base(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj")]
        parts += [lora_base(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj")]
        if not all(isinstance(p, ProjectionSlice) for p in parts):
            return "q/k/v or gate/up not fused (fuse_projections=False or quantised layers)"
        if parts[3].fused.bias is not None:
            return "gate/up projections with bias"
    from hf_paged.quantization.fp8_weights import Fp8Linear  # its GEMVs read FP8 weights too

    for lin in (lora_base(attn.o_proj), lora_base(mlp.down_proj)):
        if type(lin) not in (nn.Linear, Fp8Linear):
            return f"{type(lin).__name__} o_proj/down_proj (quantised)"
    return None


@dataclass(slots=True)
class Layer:
    """One decoder layer's modules, as the kernels take them. Modules, not tensors: weights are
    read at each call, so weights loaded into the model in place are the ones used."""

    index: int  # its KV cache in the forward context
    attn: nn.Module  # the modules holding the projections: LoRA layers are looked up per call
    mlp: nn.Module
    in_norm: nn.Module  # RMSNorm before attention
    qkv: nn.Module  # [q | k | v] rows (+ bias for Qwen2): a FusedProjection or phi3's Linear
    q_norm: nn.Module | None  # qwen3: RMSNorm of each query / key head before RoPE
    k_norm: nn.Module | None
    o: nn.Linear
    scale: float
    window: int | None  # sliding window, as the transformers attention module passes it
    softcap: float | None  # attention logit soft cap (gemma2)
    attn_out_norm: nn.Module | None  # gemma2: RMSNorm of the attention output, before the add
    mlp_norm: nn.Module  # RMSNorm before the MLP
    gate_up: nn.Module  # [gate | up] rows
    gate_rows: int
    down: nn.Linear
    mlp_out_norm: nn.Module | None  # gemma2: RMSNorm of the MLP output, before the add


def build_layers(model: nn.Module) -> list[Layer]:
    """The Layers of a transformers model unsupported_reason accepts."""
    from hf_paged.integrations.fused_projections import lora_base

    cfg = model.config.get_text_config()
    family = cfg.model_type
    gemma = family == "gemma2"
    layers = []
    for layer in decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        window = getattr(attn, "sliding_window", None)
        if window is None and family in _CONFIG_WINDOW:
            window = getattr(cfg, "sliding_window", None)
        if family == "phi3":
            qkv, gate_up = attn.qkv_proj, mlp.gate_up_proj
            gate_rows = gate_up.out_features // 2  # Phi3MLP's chunk(2): gate, then up
        else:
            qkv, gate_up = lora_base(attn.q_proj).fused, lora_base(mlp.gate_proj).fused
            gate_rows = gate_up.sizes[0]
        softcap = getattr(attn, "attn_logit_softcapping", None) if gemma else None
        layers.append(
            Layer(
                index=attn.layer_idx,
                attn=attn,
                mlp=mlp,
                in_norm=layer.input_layernorm,
                qkv=qkv,
                q_norm=attn.q_norm if family == "qwen3" else None,
                k_norm=attn.k_norm if family == "qwen3" else None,
                o=lora_base(attn.o_proj),
                scale=float(attn.scaling),
                window=int(window) if window else None,
                softcap=float(softcap) if softcap else None,
                attn_out_norm=layer.post_attention_layernorm if gemma else None,
                mlp_norm=layer.pre_feedforward_layernorm
                if gemma
                else layer.post_attention_layernorm,
                gate_up=gate_up,
                gate_rows=gate_rows,
                down=lora_base(mlp.down_proj),
                mlp_out_norm=layer.post_feedforward_layernorm if gemma else None,
            )
        )
    return layers


def activation(cfg) -> str:
    """fused_gemv's name for the model's MLP activation."""
    return _ACTIVATIONS[_activation_name(cfg)]
