"""The model forward for steps of a few tokens (batch-1 to batch-8 decode), from fused kernels.

Why: at batch 1 the H200 reads the TinyLlama-1.1B weights in 0.52 ms, but the transformers
forward (compiled, fused q/k/v and gate/up, in a CUDA graph) took 1.38 ms: 16 kernels per layer,
most of them 1-2 us launches around 2-46 MB matrix-vector products that cuBLAS streams at 1.3-3.5
TB/s. This forward runs each decoder layer as six launches (kernels/fused_gemv.py,
kernels/rope_kv.py, the paged attention kernels):

    qkv  = RMSNorm(h) @ Wqkv.T (+ b)          fused_gemv  NORM
    q    = rope(q); cache <- rope(k), v         rope_write_kv
      (or both as one launch, norm_qkv_rope, where cos/sin depend on the position alone:
       tables over positions are built once from the model's rotary module)
    a    = paged attention(q)                   decode_attention (one token a sequence:
                                                the cache is read before the PDL wait) or
                                                paged_attention (split KV + reduce)
    h    = h + a @ Wo.T                         fused_gemv  RESIDUAL
    act  = silu(RMSNorm(h) @ Wg.T) * (. @ Wu.T) fused_gemv  NORM GATED
    h    = h + act @ Wd.T                       fused_gemv  RESIDUAL

FP8 weights (quantization="fp8": Fp8Linear and fused projections holding float8_e4m3fn rows with
1x128 block scales) go through the same kernels: each dequantises its weight tile in registers
(half the bytes streamed), computing Fp8Linear's weight-only product.

A PeftModel's LoRA layers wrap the fused slices and o/down: their per-token deltas (the step's
adapter slots, hf_paged.lora) are added to the slices they wrap, so a layer with LoRA on q/k/v
takes the unfused RoPE + KV write after the delta, and one with LoRA on gate/up the ungated
GEMV, then the activation in torch.

and the final norm with the logits rows the step keeps as one more (NORM GATHER); before the
layers, kernels/embedding.py resolves the step's token ids (some sampled on the device by the
step before) and gathers their embedding rows in one launch. On Hopper the GEMVs and the
rope/KV launch use programmatic dependent launch (see kernels/fused_gemv.py).

It reads the model's own weights (nothing is copied) and its own rotary module (cos/sin for any
rope scaling), and computes what the transformers modules compute, rounding as they round; the
engine uses it only for models whose layers have exactly the structure above (`unsupported_reason`
says why not otherwise) and only inside engine steps, so the model outside the engine, and every
larger step, is transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_paged.worker.compilation import decoder_layers
from hf_paged.worker.forward_context import PendingTokens, get_forward_context

# Decoder layers that are pre-norm RMSNorm -> attention (rotate_half RoPE) -> residual ->
# RMSNorm -> SiLU-gated MLP -> residual, with the embedding unscaled and no logit softcap.
_ARCHITECTURES = ("llama", "mistral", "qwen2")


def _transformers_model(model: nn.Module) -> nn.Module:
    """A PeftModel's transformers model (its LoRA layers stay in place), else the model."""
    get = getattr(model, "get_base_model", None)
    return get() if hasattr(model, "peft_config") and get is not None else model


def unsupported_reason(model: nn.Module) -> str | None:
    """None if SmallBatchForward can run this model, else why not (fused q/k/v and gate/up
    projections are required: Engine(fuse_projections=True), the default)."""
    from hf_paged.integrations.fused_projections import ProjectionSlice, lora_base

    model = _transformers_model(model)
    cfg = model.config.get_text_config()
    if cfg.model_type not in _ARCHITECTURES:
        return f"model_type {cfg.model_type!r} is not one of {_ARCHITECTURES}"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} is not 'silu'"
    try:
        layers = decoder_layers(model)
    except ValueError as exc:
        return str(exc)
    base = getattr(model, "model", None)
    lm_head = getattr(model, "lm_head", None)
    if base is None or type(lm_head) is not nn.Linear or lm_head.bias is not None:
        return "no base model, or lm_head is not a plain bias-free nn.Linear"
    if not isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        return "embed_tokens is not an nn.Embedding"
    if base.embed_tokens.weight.stride(-1) != 1:  # kernels/embedding.py reads whole rows
        return "embed_tokens.weight rows are not contiguous"
    if getattr(base, "rotary_emb", None) is None or not _is_rms_norm(getattr(base, "norm", None)):
        return "no rotary_emb or final RMSNorm"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of 2"
    from hf_paged.kernels.fused_gemv import tile_config

    for k, gated in ((cfg.hidden_size, True), (cfg.intermediate_size, False)):
        if tile_config(k, gated) is None:
            return f"in_features {k}: a GEMV weight row does not fit in registers"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return "a decoder layer without self_attn / mlp"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(_is_rms_norm(n) for n in norms):
            return "a decoder layer whose norms are not RMSNorm"
        parts = [lora_base(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj")]
        parts += [lora_base(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj")]
        if not all(isinstance(p, ProjectionSlice) for p in parts):
            return "q/k/v or gate/up not fused (fuse_projections=False or quantised layers)"
        if parts[3].fused.bias is not None:
            return "gate/up projections with bias"
        for lin in (lora_base(attn.o_proj), lora_base(mlp.down_proj)):
            if type(lin) is not nn.Linear and type(lin).__name__ != "Fp8Linear":
                return f"{type(lin).__name__} o_proj/down_proj (quantised)"
    return None


def _is_rms_norm(module) -> bool:
    return (
        module is not None
        and type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and hasattr(module, "variance_epsilon")
    )


@dataclass(slots=True)
class _Layer:
    """One decoder layer's modules, as the kernels take them. Modules, not tensors: weights are
    read at each call, so weights loaded into the model in place are the ones used."""

    index: int  # its KV cache in the forward context
    attn: nn.Module  # the modules holding the projections: LoRA layers are looked up per call
    mlp: nn.Module
    in_norm: nn.Module  # RMSNorm before attention
    qkv: nn.Module  # FusedProjection: [q | k | v] rows (+ bias for Qwen2)
    o: nn.Linear
    scale: float
    window: int | None  # sliding window, as the transformers attention module passes it
    post_norm: nn.Module  # RMSNorm before the MLP
    gate_up: nn.Module  # FusedProjection: [gate | up] rows
    gate_rows: int
    down: nn.Linear


class SmallBatchForward:
    """forward(input_ids [T], positions [T], keep [R]) -> logits [R, vocab] for T <= max_rows,
    inside an engine step (the forward context holds the KV caches and attention metadata)."""

    def __init__(
        self,
        model: nn.Module,
        max_rows: int,
        pdl: bool,
        max_positions: int | None = None,
    ) -> None:
        from hf_paged import kernels
        from hf_paged.integrations.fused_projections import lora_base

        self.kernels = kernels
        self.lora = hasattr(model, "peft_config")  # LoRA deltas looked for at each call
        model = _transformers_model(model)
        cfg = model.config.get_text_config()
        self.max_rows = max_rows
        self.pdl = pdl
        self.base = model.model
        self.lm_head = model.lm_head
        self.num_q_heads = cfg.num_attention_heads
        self.layers = []
        self.cos_table = self.sin_table = None
        if max_positions:
            self.cos_table, self.sin_table = _half_rotary_tables(model, max_positions)
        for layer in decoder_layers(model):
            attn, mlp = layer.self_attn, layer.mlp
            window = getattr(attn, "sliding_window", None)
            if window is None and cfg.model_type == "mistral":  # passed from the config there
                window = getattr(cfg, "sliding_window", None)
            self.layers.append(
                _Layer(
                    index=attn.layer_idx,
                    attn=attn,
                    mlp=mlp,
                    in_norm=layer.input_layernorm,
                    qkv=lora_base(attn.q_proj).fused,
                    o=lora_base(attn.o_proj),
                    scale=float(attn.scaling),
                    window=int(window) if window else None,
                    post_norm=layer.post_attention_layernorm,
                    gate_up=lora_base(mlp.gate_proj).fused,
                    gate_rows=lora_base(mlp.gate_proj).fused.sizes[0],
                    down=lora_base(mlp.down_proj),
                )
            )

    def _cos_sin(self, h: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.base.rotary_emb(h[None], positions[None])
        return cos[0], sin[0]

    def __call__(
        self, input_ids: torch.Tensor | PendingTokens, positions: torch.Tensor, keep: torch.Tensor
    ):
        k = self.kernels
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        pdl = self.pdl
        table = self.base.embed_tokens.weight
        if isinstance(input_ids, PendingTokens):  # tokens the step before sampled: resolved here
            t = input_ids
            h = k.embed_tokens(table, t.input_ids, t.pending, t.rows, t.last_tokens, pdl=pdl)
        else:
            h = k.embed_tokens(table, input_ids, pdl=pdl)  # [T, hidden]
        tables = self.cos_table is not None
        cos = sin = None
        if not tables:  # per step, from the model's rotary module
            cos, sin = self._cos_sin(h, positions)
        t = h.shape[0]
        decode = meta.max_query_len == 1 and t == meta.num_seqs
        for layer in self.layers:
            lora = _lora_wrappers(layer) if self.lora else None
            norm = layer.in_norm
            key_cache, value_cache = ctx.kv_caches[layer.index]
            qkv_lora = lora is not None and any(lora[n] for n in ("q_proj", "k_proj", "v_proj"))
            if tables and not qkv_lora:  # norm + q/k/v + RoPE + KV write: one launch
                q = k.norm_qkv_rope(
                    h,
                    layer.qkv.weight,
                    layer.qkv.bias,
                    norm.weight,
                    norm.variance_epsilon,
                    positions,
                    self.cos_table,
                    self.sin_table,
                    key_cache,
                    value_cache,
                    meta.slot_mapping,
                    self.num_q_heads,
                    weight_scale=_scales(layer.qkv),
                    pdl=pdl,
                )
            else:
                normed = torch.empty_like(h) if qkv_lora else None  # the deltas' input
                qkv = k.fused_gemv(
                    h,
                    layer.qkv.weight,
                    norm_weight=norm.weight,
                    eps=norm.variance_epsilon,
                    bias=layer.qkv.bias,
                    weight_scale=_scales(layer.qkv),
                    norm_out=normed,
                    pdl=pdl,
                )
                if qkv_lora:  # the deltas before RoPE and the KV write
                    names = ("q_proj", "k_proj", "v_proj")
                    _add_deltas(qkv, normed, [lora[n] for n in names], layer.qkv.sizes)
                    if cos is None:
                        cos, sin = self._cos_sin(h, positions)
                q = k.rope_write_kv(
                    qkv,
                    cos,
                    sin,
                    key_cache,
                    value_cache,
                    meta.slot_mapping,
                    self.num_q_heads,
                    pdl=pdl,
                )
            if decode:  # every sequence one new token: read the old K/V before the PDL wait
                attn = k.decode_attention(
                    q, key_cache, value_cache, meta, layer.scale, layer.window, None, pdl=pdl
                )
            else:
                attn = ctx.backend.paged_attention(
                    q, key_cache, value_cache, meta, layer.scale, layer.window, None, pdl=pdl
                )
            o, attn = layer.o, attn.view(t, -1)
            h = k.fused_gemv(
                attn, o.weight, bias=o.bias, residual=h, weight_scale=_scales(o), pdl=pdl
            )
            if lora is not None:
                _add_deltas(h, attn, [lora["o_proj"]])
            norm, gate_up, rows = layer.post_norm, layer.gate_up.weight, layer.gate_rows
            gu_scale = _scales(layer.gate_up)
            if lora is None or not (lora["gate_proj"] or lora["up_proj"]):
                act = k.fused_gemv(
                    h,
                    gate_up[:rows],
                    up_weight=gate_up[rows:],
                    norm_weight=norm.weight,
                    eps=norm.variance_epsilon,
                    weight_scale=None if gu_scale is None else gu_scale[:rows],
                    up_scale=None if gu_scale is None else gu_scale[rows:],
                    pdl=pdl,
                )
            else:  # the deltas before the activation: the ungated GEMV, then act(gate) * up
                normed = torch.empty_like(h)
                gu = k.fused_gemv(
                    h, gate_up, norm_weight=norm.weight, eps=norm.variance_epsilon,
                    weight_scale=gu_scale, norm_out=normed,
                )  # fmt: skip
                wrappers = [lora["gate_proj"], lora["up_proj"]]
                _add_deltas(gu, normed, wrappers, layer.gate_up.sizes)
                act = layer.mlp.act_fn(gu[:, :rows]) * gu[:, rows:]
            down = layer.down
            h_in, h = (
                act,
                k.fused_gemv(
                    act,
                    down.weight,
                    bias=down.bias,
                    residual=h,
                    weight_scale=_scales(down),
                    pdl=pdl,
                ),
            )
            if lora is not None:
                _add_deltas(h, h_in, [lora["down_proj"]])
        norm = self.base.norm
        return k.fused_gemv(
            h,
            self.lm_head.weight,
            norm_weight=norm.weight,
            eps=norm.variance_epsilon,
            rows=keep,
            pdl=pdl,
        )


def _scales(module: nn.Module) -> torch.Tensor | None:
    """An FP8 layer's block scales (quantization="fp8": Fp8Linear or a fused projection's
    buffer); None for a float weight."""
    return module._buffers.get("weight_scale")


def _lora_wrappers(layer: _Layer) -> dict | None:
    """The layer's peft LoRA layers whose deltas apply in engine steps (routed: they hold the
    slot buffers), by projection name; None when there are none. Looked up per call: peft may
    wrap a projection for an adapter loaded while the engine runs."""
    from hf_paged.lora.slots import A

    found, any_ = {}, False
    for holder, names in (
        (layer.attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
        (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
    ):
        for name in names:
            m = getattr(holder, name)
            live = (
                hasattr(m, "lora_A")
                and getattr(m, A, None) is not None
                and not (m.disable_adapters or m.merged)
            )
            found[name] = m if live else None
            any_ |= live
    return found if any_ else None


def _add_deltas(y: torch.Tensor, x: torch.Tensor, wrappers: list, sizes=None) -> None:
    """y's column slices (sizes; one slice: all of y) += each LoRA layer's per-token delta of x
    (the step's adapter slots), through the op the LoRA layers use (hf_paged.lora.layers)."""
    from hf_paged.lora.layers import lora_add_
    from hf_paged.lora.slots import SCALE, A, B

    start = 0
    for wrapper, size in zip(wrappers, sizes or [y.shape[-1]], strict=True):
        if wrapper is not None:
            part = y[:, start : start + size]
            lora_add_(part, x, getattr(wrapper, A), getattr(wrapper, B), getattr(wrapper, SCALE))
        start += size


# Rotary types whose cos/sin depend on the position alone (dynamic NTK and longrope rescale with
# the sequence length, so they are computed per step instead).
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _half_rotary_tables(model: nn.Module, max_positions: int):
    """cos/sin [max_positions, D/2] from the model's own rotary module, or (None, None) where
    they cannot stand for it (a dynamic rope type, halves that differ, a tile too wide)."""
    from hf_paged.kernels.qkv_rope import qkv_rope_config

    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", "default") not in _STATIC_ROPE:
        return None, None
    param = next(model.parameters())
    positions = torch.arange(max_positions, device=param.device)[None]
    with torch.no_grad():
        cos, sin = rotary(torch.empty(0, device=param.device, dtype=param.dtype), positions)
    cos, sin = cos[0], sin[0]
    half = cos.shape[-1] // 2
    if not (
        torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    ):
        return None, None
    if qkv_rope_config(model.config.get_text_config().hidden_size, half) is None:
        return None, None
    return cos[:, :half].contiguous(), sin[:, :half].contiguous()
