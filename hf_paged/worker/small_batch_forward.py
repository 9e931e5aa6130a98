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

Steps of more than kernels.ROW_SERIAL_ROWS (2) tokens: fused_gemv hands the products to
kernels/fused_gemm_rows.py (tensor cores, the same fused options) and q/k/v takes two launches
(the GEMV, then rope_write_kv), since norm_qkv_rope's and fused_gemv's own GEMVs compute the rows
one after another; with FP8 weights or LoRA deltas the row-serial kernels stay.

FP8 weights (quantization="fp8": Fp8Linear and fused projections holding float8_e4m3fn rows with
1x128 block scales) go through the same kernels: each dequantises its weight tile in registers
(half the bytes streamed), computing Fp8Linear's weight-only product.

A PeftModel's LoRA layers wrap the fused slices and o/down: their per-token deltas (the step's
adapter slots, hf_paged.lora) are added inside the GEMVs' epilogues (kernels/fused_gemv.py,
LoraEpilogue), each GEMV after one shrink launch over its group's stacked A (q/k/v together,
gate/up together; for those the shrink takes x times the norm weight, and the GEMV, which
computes each row's 1 / rms, multiplies it in): 4 extra launches a layer. The one-launch
norm + q/k/v + RoPE + KV write takes the q/k/v deltas the same way. (Were a slice's
LoRA layer disabled or merged on its own, its group's live slices add their deltas one by one
after an ungated GEMV, as peft would.)

and the final norm with the logits rows the step keeps as one more (NORM GATHER); before the
layers, kernels/embedding.py resolves the step's token ids (some sampled on the device by the
step before) and gathers their embedding rows in one launch. On Hopper the GEMVs and the
rope/KV launch use programmatic dependent launch (see kernels/fused_gemv.py).

It reads the model's own weights (nothing is copied) and its own rotary module (cos/sin for any
rope scaling), and computes what the transformers modules compute, rounding as they round; the
engine uses it only for the families small_batch_layers.py names, whose layers are the structure
above with named differences (`unsupported_reason` says why not otherwise), and only inside
engine steps, so the model outside the engine, and every larger step, is transformers' forward.
The differences: Qwen3's per-head q/k norms inside rope_write_kv (so no one-launch
norm_qkv_rope); Gemma 2's (1 + w) norms and GELU(tanh) gate as fused_gemv options, its sandwich
norms as residual + norm(product) in one launch (kernels/residual_norm.py) after an un-fused
GEMV, its embedding scale and final softcap in torch, attention softcap / window / scale passed
to the attention kernels; Phi-3's own fused qkv_proj / gate_up_proj read as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_paged.lora.layers import grouped, live, lora_add_
from hf_paged.lora.slots import GROUP_A, GROUP_B, GROUP_SCALE, SCALE, A, B
from hf_paged.worker.forward_context import PendingTokens, get_forward_context
from hf_paged.worker.small_batch_layers import (
    Layer,
    activation,
    build_layers,
    norm_eps,
    transformers_model,
    unsupported_reason,
)

__all__ = ["SmallBatchForward", "unsupported_reason"]


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

        self.kernels = kernels
        self.lora = hasattr(model, "peft_config")  # LoRA deltas looked for at each call
        model = transformers_model(model)
        cfg = model.config.get_text_config()
        self.max_rows = max_rows
        self.pdl = pdl
        self.base = model.model
        self.lm_head = model.lm_head
        self.num_q_heads = cfg.num_attention_heads
        self.layers = build_layers(model)
        gemma = cfg.model_type == "gemma2"
        self.norm_plus_one = gemma  # Gemma2RMSNorm: x * (1 + w), rounded once
        self.activation = activation(cfg)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) if gemma else None
        self.cos_table = self.sin_table = None
        # the one-launch norm + q/k/v + RoPE computes LlamaRMSNorm and no head norms
        one_launch = not gemma and all(layer.q_norm is None for layer in self.layers)
        if max_positions and one_launch:
            self.cos_table, self.sin_table = _half_rotary_tables(model, max_positions)

    def _cos_sin(self, h: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.base.rotary_emb(h[None], positions[None])
        return cos[0], sin[0]

    def _embed(self, input_ids: torch.Tensor | PendingTokens) -> torch.Tensor:
        k, pdl = self.kernels, self.pdl
        embed = self.base.embed_tokens
        if isinstance(input_ids, PendingTokens):  # tokens the step before sampled: resolved here
            t = input_ids
            h = k.embed_tokens(embed.weight, t.input_ids, t.pending, t.rows, t.last_tokens, pdl=pdl)
        else:
            h = k.embed_tokens(embed.weight, input_ids, pdl=pdl)  # [T, hidden]
        scale = getattr(embed, "embed_scale", None)
        if scale is not None:  # Gemma2TextScaledWordEmbedding: the scale in the model dtype
            h = h * scale.to(embed.weight.dtype)
        return h

    def _norm_gemv(self, x: torch.Tensor, weight: torch.Tensor, norm: nn.Module, **kw):
        return self.kernels.fused_gemv(
            x,
            weight,
            norm_weight=norm.weight,
            eps=norm_eps(norm),
            norm_plus_one=self.norm_plus_one,
            pdl=self.pdl,
            **kw,
        )

    def _shrink(self, x, deltas: _Deltas | None, norm: nn.Module | None = None):
        """The GEMV epilogue's LoRA input: one shrink of x (of x * the norm's weight with norm,
        the GEMV multiplying in each row's 1 / rms) over the deltas' stacked A; None without
        deltas."""
        if deltas is None:
            return None
        batch = get_forward_context().lora_groups
        kw = {}
        if norm is not None:  # x * g: the GEMV multiplies in each row's 1 / rms
            kw = dict(norm_weight=norm.weight, norm_plus_one=self.norm_plus_one)
        s = self.kernels.lora_rows_shrink(x, deltas.a, batch.token_slots, pdl=self.pdl, **kw)
        return self.kernels.LoraEpilogue(
            s, deltas.b, deltas.scale, batch.token_slots, deltas.slices, rms=norm is not None
        )

    def _qkv_rope(self, layer: Layer, h, positions, cos, sin, lora, key_cache, value_cache):
        """Rotated queries [T, Hq, D]; rotated keys and values written to the cache."""
        k, ctx = self.kernels, get_forward_context()
        slots = ctx.attn_metadata.slot_mapping
        group = lora.qkv if lora is not None else None
        alone = lora.qkv_alone if lora is not None else None
        norm = layer.in_norm
        # norm + q/k/v (+ deltas) + RoPE + KV write in one launch, whose GEMV computes the rows
        # one after another: where fused_gemv would take tensor cores, q/k/v goes there instead
        tc = k.tensor_core_rows(h.shape[0], layer.qkv.weight.dtype, group)
        if self.cos_table is not None and not alone and not tc:
            return k.norm_qkv_rope(
                h,
                layer.qkv.weight,
                layer.qkv.bias,
                norm.weight,
                norm_eps(norm),
                positions,
                self.cos_table,
                self.sin_table,
                key_cache,
                value_cache,
                slots,
                self.num_q_heads,
                weight_scale=_scales(layer.qkv),
                pdl=self.pdl,
                lora=self._shrink(h, group, norm),
            )
        normed = torch.empty_like(h) if alone else None  # the deltas' input, from the GEMV
        qkv = self._norm_gemv(  # the deltas before the head norms, RoPE and the KV write
            h,
            layer.qkv.weight,
            norm,
            bias=layer.qkv.bias,
            weight_scale=_scales(layer.qkv),
            norm_out=normed,
            lora=self._shrink(h, group, norm),
        )
        if alone:
            _add_deltas(qkv, normed, alone, layer.qkv.sizes)
        if cos is None:
            cos, sin = self._cos_sin(h, positions)
        head_norms = {}
        if layer.q_norm is not None:
            head_norms = dict(
                q_norm_weight=layer.q_norm.weight,
                k_norm_weight=layer.k_norm.weight,
                eps=norm_eps(layer.q_norm),
            )
        return k.rope_write_kv(
            qkv, cos, sin, key_cache, value_cache, slots, self.num_q_heads, pdl=self.pdl,
            **head_norms,
        )  # fmt: skip

    def __call__(
        self, input_ids: torch.Tensor | PendingTokens, positions: torch.Tensor, keep: torch.Tensor
    ):
        k = self.kernels
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        pdl = self.pdl
        h = self._embed(input_ids)
        cos = sin = None
        t = h.shape[0]
        if self.cos_table is None or t > k.ROW_SERIAL_ROWS:  # per step, from the rotary module
            cos, sin = self._cos_sin(h, positions)
        decode = meta.max_query_len == 1 and t == meta.num_seqs
        on = self.lora and ctx.lora_groups is not None  # else no token of the step has one
        for layer in self.layers:
            lora = _layer_lora(layer) if on else None
            key_cache, value_cache = ctx.kv_caches[layer.index]
            q = self._qkv_rope(layer, h, positions, cos, sin, lora, key_cache, value_cache)
            args = (key_cache, value_cache, meta, layer.scale, layer.window, layer.softcap)
            if decode:  # every sequence one new token: read the old K/V before the PDL wait
                attn = k.decode_attention(q, *args, pdl=pdl)
            else:
                attn = ctx.backend.paged_attention(q, *args, pdl=pdl)
            deltas = lora.o if lora is not None else None
            h = self._residual_gemv(attn.view(t, -1), layer.o, h, layer.attn_out_norm, deltas)
            norm, gate_up, rows = layer.mlp_norm, layer.gate_up.weight, layer.gate_rows
            scale = _scales(layer.gate_up)
            if lora is None or lora.gate_up_alone is None:  # the deltas in the epilogue
                act = self._norm_gemv(
                    h,
                    gate_up[:rows],
                    norm,
                    up_weight=gate_up[rows:],
                    activation=self.activation,
                    weight_scale=None if scale is None else scale[:rows],
                    up_scale=None if scale is None else scale[rows:],
                    lora=self._shrink(h, lora.gate_up if lora is not None else None, norm),
                )
            else:  # the deltas before the activation: the ungated GEMV, then act(gate) * up
                normed = torch.empty_like(h)
                gu = self._norm_gemv(h, gate_up, norm, weight_scale=scale, norm_out=normed)
                _add_deltas(gu, normed, lora.gate_up_alone, layer.gate_up.sizes)
                act = layer.mlp.act_fn(gu[:, :rows]) * gu[:, rows:]
            deltas = lora.down if lora is not None else None
            h = self._residual_gemv(act, layer.down, h, layer.mlp_out_norm, deltas)
        logits = self._norm_gemv(h, self.lm_head.weight, self.base.norm, rows=keep)
        if self.final_softcap:  # as Gemma2ForCausalLM: divide, tanh, multiply
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _residual_gemv(self, x, linear: nn.Linear, residual, out_norm, deltas):
        """residual + x @ W.T (+ b), or with out_norm (Gemma 2's sandwich norms) residual +
        out_norm(x @ W.T); deltas: the LoRA layer's around the linear, added to the product
        (before out_norm) in the GEMV's epilogue."""
        k, scale = self.kernels, _scales(linear)
        lora = self._shrink(x, deltas)
        if out_norm is None:
            return k.fused_gemv(
                x, linear.weight, bias=linear.bias, residual=residual, weight_scale=scale,
                pdl=self.pdl, lora=lora,
            )  # fmt: skip
        y = k.fused_gemv(
            x, linear.weight, bias=linear.bias, weight_scale=scale, pdl=self.pdl, lora=lora
        )
        return k.residual_rms_norm(
            y, residual, out_norm.weight, norm_eps(out_norm), self.norm_plus_one, pdl=self.pdl
        )


def _scales(module: nn.Module) -> torch.Tensor | None:
    """An FP8 layer's block scales (quantization="fp8": Fp8Linear or a fused projection's
    buffer); None for a float weight."""
    return module._buffers.get("weight_scale")


@dataclass(slots=True)
class _Deltas:
    """A projection's LoRA for a GEMV epilogue: its stacked slot buffers (a fused group's
    covering every slice), as kernels/lora.py takes them."""

    a: torch.Tensor  # [max_loras, slices * max_lora_rank, in]
    b: torch.Tensor  # [max_loras, out, max_lora_rank]
    scale: torch.Tensor  # f32 [slices, max_loras]
    slices: tuple[int, ...]


@dataclass(slots=True)
class _LayerLora:
    qkv: _Deltas | None
    o: _Deltas | None
    gate_up: _Deltas | None
    down: _Deltas | None
    # a group whose LoRA layers are not all live: the live ones' layers, added one by one
    qkv_alone: list | None = None
    gate_up_alone: list | None = None


def _layer_lora(layer: Layer) -> _LayerLora | None:
    """The layer's LoRA deltas that apply in engine steps (routed LoRA layers: they hold the
    slot buffers), None when there are none. Looked up per call: peft may wrap a projection
    for an adapter loaded while the engine runs."""

    def group(fused, holder, names):
        wrappers = [getattr(holder, n) for n in names]
        wrappers = [w if hasattr(w, "lora_A") and live(w) else None for w in wrappers]
        if grouped(fused):
            buf = fused._buffers
            return _Deltas(buf[GROUP_A], buf[GROUP_B], buf[GROUP_SCALE], tuple(fused.sizes)), None
        return None, (wrappers if any(w is not None for w in wrappers) else None)

    def single(m):
        if not (hasattr(m, "lora_A") and live(m)):
            return None
        return _Deltas(getattr(m, A), getattr(m, B), getattr(m, SCALE)[None], (m.out_features,))

    qkv, qkv_alone = group(layer.qkv, layer.attn, ("q_proj", "k_proj", "v_proj"))
    gate_up, gate_up_alone = group(layer.gate_up, layer.mlp, ("gate_proj", "up_proj"))
    parts = (qkv, single(layer.attn.o_proj), gate_up, single(layer.mlp.down_proj))
    if all(p is None for p in parts) and qkv_alone is None and gate_up_alone is None:
        return None
    return _LayerLora(*parts, qkv_alone, gate_up_alone)


def _add_deltas(y: torch.Tensor, x: torch.Tensor, wrappers: list, sizes=None) -> None:
    """y's column slices (sizes; one slice: all of y) += each LoRA layer's per-token delta of x
    (the step's adapter slots), through the op the LoRA layers use (hf_paged.lora.layers)."""

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
    if half & (half - 1):  # norm_qkv_rope's head tile: head_dim 80 / 96 take rope_write_kv
        return None, None
    if not (
        torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    ):
        return None, None
    if qkv_rope_config(model.config.get_text_config().hidden_size, half) is None:
        return None, None
    return cos[:, :half].contiguous(), sin[:, :half].contiguous()
