"""Paged attention as a transformers attention function, and the backends that compute it.

transformers' attention modules keep their projections, rotary embeddings and norms and call
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=..., ...)`.
`patch()` points that at `paged_attention_forward`, which writes the step's new K/V into the
paged cache and attends over each sequence's block table. Outside an engine step (a patched model
called directly) it falls back to transformers' sdpa, so the model still works as before.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hf_paged.quantization.kv_cache import fold_head_scales
from hf_paged.worker.forward_context import AttentionMetadata, get_forward_context, in_engine_step

ATTN_IMPLEMENTATION = "hf_paged"


class AttentionBackend:
    """write_kv + paged_attention over the contract in hf_paged.worker.forward_context."""

    name = "base"
    graph_safe = False  # no host syncs or host-dependent control flow: CUDA-graph capturable

    def write_kv(
        self, key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0
    ) -> None:
        """k_scale, v_scale: FP8 caches store key / k_scale (hf_paged/quantization/kv_cache.py)."""
        raise NotImplementedError

    def paged_attention(
        self,
        query,
        key_cache,
        value_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        pdl: bool = False,  # programmatic dependent launch (Triton on Hopper); others ignore it
        sinks: torch.Tensor | None = None,  # [Hq] attention sinks (gpt-oss's s_aux)
        k_scale: float = 1.0,  # FP8 caches: a key is k_scale * its stored value
        v_scale: float = 1.0,
        alibi_slopes: torch.Tensor | None = None,  # [Hq] ALiBi slopes (Bloom, MPT, Falcon)
    ) -> torch.Tensor:
        raise NotImplementedError


class TorchBackend(AttentionBackend):
    """Pure torch: the CPU path, and the reference the Triton kernels are tested against."""

    name = "torch"
    # loops over sequences with host ints: not CUDA-graph capturable (graph_safe stays False)

    def write_kv(
        self, key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0
    ) -> None:
        from hf_paged.kernels import write_kv_ref

        write_kv_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def paged_attention(
        self,
        query,
        key_cache,
        value_cache,
        meta,
        scale,
        sliding_window,
        softcap,
        pdl=False,
        sinks=None,
        k_scale=1.0,
        v_scale=1.0,
        alibi_slopes=None,
    ):
        from hf_paged.kernels import paged_attention_ref

        return paged_attention_ref(
            query, key_cache, value_cache, meta, scale, sliding_window, softcap, sinks,
            k_scale, v_scale,
            alibi_slopes,
        )  # fmt: skip


class TritonBackend(AttentionBackend):
    """The Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1, for tests)."""

    name = "triton"
    graph_safe = True

    def __init__(self) -> None:
        from hf_paged import kernels

        if not hasattr(kernels, "paged_attention") or not hasattr(kernels, "write_kv"):
            raise ValueError("attention_backend='triton': the Triton kernels are not available")
        self._kernels = kernels

    def write_kv(
        self, key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0
    ) -> None:
        self._kernels.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def paged_attention(
        self,
        query,
        key_cache,
        value_cache,
        meta,
        scale,
        sliding_window,
        softcap,
        pdl=False,
        sinks=None,
        k_scale=1.0,
        v_scale=1.0,
        alibi_slopes=None,
    ):
        return self._kernels.paged_attention(
            query,
            key_cache,
            value_cache,
            meta,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
            pdl=pdl,
            k_scale=k_scale,
            v_scale=v_scale,
        )


def make_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    if name == "auto" and device.type == "cuda":
        try:
            backend = TritonBackend()
        except ValueError:
            backend = TorchBackend()
    else:
        backend = TritonBackend() if name == "triton" else TorchBackend()
    if backend.name == "triton" and block_size & (block_size - 1):
        # the kernels tile a block with tl.arange, which takes powers of two only
        raise ValueError(
            f"block_size must be a power of two with the Triton attention backend, got {block_size}"
        )
    return backend


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]: the flat batch is one "row" to transformers
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if not in_engine_step():  # a patched model called directly: exactly transformers' sdpa
        if _recorded_shapes is not None:  # KVCacheSpec's probe forward: shapes, not values
            _record_kv_shape(module, query, key, value)
            # zeros of the output's shape: the probe must not fail where transformers' sdpa
            # would on the model's geometry (MLA's K heads against a config's KV-head count)
            batch, num_heads, q_len = query.shape[:3]
            return query.new_zeros(batch, q_len, num_heads, value.shape[-1]), None
        if kwargs.get("s_aux") is not None:  # sdpa would drop the sinks: the model's own eager
            q_len, k_len = query.shape[2], key.shape[2]
            if attention_mask is None and q_len > 1:  # sdpa's mask skipped for is_causal
                causal = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device)
                attention_mask = causal.tril(k_len - q_len)[None, None]
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                # paged_mask built sdpa's boolean mask; eager attention adds a float one
                zero = torch.zeros((), dtype=query.dtype, device=query.device)
                attention_mask = zero.masked_fill(~attention_mask, torch.finfo(query.dtype).min)
            return _eager_with_sinks(module)(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                sliding_window=sliding_window, softcap=softcap, **kwargs,
            )  # fmt: skip
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            softcap=softcap,
            **kwargs,
        )
    if query.shape[0] != 1:
        raise ValueError(f"paged attention expects the flat batch as one row, got {query.shape}")
    _refuse_unsupported(module, kwargs)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    window = int(sliding_window) if sliding_window else 0
    cap = float(softcap) if softcap else 0.0
    # attention sinks (gpt-oss and kin pass them as s_aux): one extra softmax logit per head
    sinks = kwargs.get("s_aux")
    # ALiBi slopes, one per query head: passed by the attention adapters of Bloom, MPT and
    # Falcon's ALiBi variant (integrations/attention_forwards.py); no transformers model passes
    # them through the attention interface
    alibi = kwargs.get("alibi_slopes")
    # compile_scope="layers" registers the layer index as a CPU tensor buffer: as a Python int it
    # would be a constant guarded per layer, and compiled decoder layers would compile once per
    # layer instead of sharing one graph (hf_paged/worker/compilation.py).
    layer_t = module._buffers.get(LAYER_BUFFER) if hasattr(module, "_buffers") else None
    layer_idx = getattr(module, "layer_idx", None) if layer_t is None else None
    if layer_t is None and layer_idx is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx: cannot pick its KV cache")
    if not torch.compiler.is_compiling():
        layer = int(layer_t) if layer_t is not None else layer_idx
        out = _paged_attention(q, k, v, layer, float(scaling), window, cap, sinks, alibi)
    elif layer_t is not None:
        # opaque to dynamo/inductor: they see one op per layer, not our kernels' Python wrappers
        out = torch.ops.hf_paged.paged_attention_t(
            q, k, v, layer_t, float(scaling), window, cap, sinks, alibi
        )
    else:
        out = torch.ops.hf_paged.paged_attention(
            q, k, v, layer_idx, float(scaling), window, cap, sinks, alibi
        )
    return out.unsqueeze(0), None  # [1, T, Hq, D], as transformers' attention functions return


# layer_idx -> (num_kv_heads, k_head_dim, v_head_dim, extra keys) while recording_kv_shapes()
# is active; extra keys: how many more key rows than queries the call passed without a cache
_recorded_shapes: dict[int, tuple[int, int, int, int]] | None = None


@contextlib.contextmanager
def recording_kv_shapes():
    """Record the K/V shapes each layer's attention call passes during a forward outside an
    engine step (the model under this attention function): the paged cache is sized from what
    the model computes, not from config fields that name it differently per family."""
    global _recorded_shapes
    shapes: dict[int, tuple[int, int, int, int]] = {}
    previous, _recorded_shapes = _recorded_shapes, shapes
    try:
        yield shapes
    finally:
        _recorded_shapes = previous


def _record_kv_shape(module: torch.nn.Module, query, key, value) -> None:
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, int) and key.dim() == 4 and value.dim() == 4:
        # key/value [batch, Hkv, T, D]; a layer's first call wins (a second one is the start-up
        # check's to catch)
        extra = key.shape[2] - query.shape[2]
        _recorded_shapes.setdefault(layer, (key.shape[1], key.shape[-1], value.shape[-1], extra))


def _eager_with_sinks(module: torch.nn.Module):
    """The eager attention of the module's modelling file, which applies s_aux (gpt-oss and
    kin define it there; sdpa has no sinks)."""
    import sys

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"{type(module).__name__}: attention sinks (s_aux) outside an engine step need the "
            "model's eager attention, which its modelling module does not define"
        )
    return eager


# Arguments some architectures pass that change attention's meaning; paged attention here is causal
# softmax attention only, so these are refused rather than silently dropped.
# (s_aux, attention sinks, is implemented; "sinks" by that name is no known model's and may not
# mean the same.)
_UNSUPPORTED_KWARGS = ("sinks", "position_bias", "indices", "block_indices")


def _bidirectional(module: torch.nn.Module, kwargs: dict) -> bool:
    """is_causal=False, from the call or the module, unless the module is a decoder's attention
    that keeps the flag's default (BigBird-Pegasus's decoder self-attention: copied from Bart's
    class without is_causal=True, made causal by the decoder's causal mask). The call's own
    is_causal=False always counts; the start-up check measures the rest."""
    if "is_causal" in kwargs:
        return kwargs["is_causal"] is False
    return (
        getattr(module, "is_causal", True) is False
        and getattr(module, "is_decoder", None) is not True
    )


def _refuse_unsupported(module: torch.nn.Module, kwargs: dict) -> None:
    if _bidirectional(module, kwargs):
        # sdpa reads the module's is_causal when the call passes none (BERT-family LM heads
        # built without config.is_decoder=True attend both ways)
        raise ValueError(
            f"{type(module).__name__}: non-causal (bidirectional) attention (is_causal=False; "
            "a BERT-family model is causal only with config.is_decoder=True) is not supported "
            "by hf_paged"
        )
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__}: attention argument {name!r} (e.g. attention sinks or "
                "position bias) is not supported by hf_paged"
            )


def _paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V for one layer, then attend; [T, Hq, Dv] contiguous."""
    ctx = get_forward_context()
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"layer {layer_idx}: attention sinks (s_aux) of shape {tuple(sinks.shape)}, expected "
            f"one per query head ({q.shape[1]},)"
        )
    key_cache, value_cache = ctx.kv_caches[layer_idx]
    if k.shape[0] != q.shape[0]:
        raise ValueError(
            f"layer {layer_idx}: attention called with {k.shape[0]} keys for {q.shape[0]} "
            "queries: the model attends over entries other than the step's tokens (e.g. "
            "compressed or memory KV), which the paged cache does not hold"
        )
    if k.shape[1:] != key_cache.shape[2:] or v.shape[1:] != value_cache.shape[2:]:
        raise ValueError(
            f"layer {layer_idx}: key/value heads and sizes {tuple(k.shape[1:])} / "
            f"{tuple(v.shape[1:])} do not match the KV cache's {tuple(key_cache.shape[2:])} / "
            f"{tuple(value_cache.shape[2:])}: the model's attention passes other shapes than "
            "the start-up probe saw"
        )
    backend = ctx.backend
    k_scale, v_scale = ctx.kv_scales[layer_idx] if ctx.kv_scales is not None else (1.0, 1.0)
    out_scale = None
    if isinstance(k_scale, torch.Tensor):  # FP8 cache, one scale per KV head: folded around
        q, k, v, out_scale = fold_head_scales(q, k, v, k_scale, v_scale)
        k_scale = v_scale = 1.0
    slots = ctx.attn_metadata.slot_mapping
    backend.write_kv(k, v, key_cache, value_cache, slots, k_scale, v_scale)
    out = backend.paged_attention(
        q,
        key_cache,
        value_cache,
        ctx.attn_metadata,
        scale,
        sliding_window or None,
        softcap or None,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        alibi_slopes=alibi,
    )
    if out_scale is not None:
        out = (out.float() * out_scale).to(out.dtype)
    return out.contiguous()


@torch.library.custom_op("hf_paged::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    # The KV-cache write is a side effect on tensors held by the forward context, not on the
    # op's arguments, so the op declares no mutated args; its output feeds o_proj, which keeps
    # the per-layer order.
    return _paged_attention(q, k, v, layer_idx, scale, sliding_window, softcap, sinks, alibi)


@torch.library.custom_op("hf_paged::paged_attention_t", mutates_args=())
def _paged_attention_t_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same, with the layer index as a CPU scalar tensor (per-layer compilation); reading
    it costs no device sync."""
    return _paged_attention(q, k, v, int(layer), scale, sliding_window, softcap, sinks, alibi)


def _attention_shape(q, k, v, layer, scale, sliding_window, softcap, sinks=None, alibi=None):
    return q.new_empty((*q.shape[:2], v.shape[-1]))  # for tracing: [T, Hq, value head size]


_paged_attention_op.register_fake(_attention_shape)
_paged_attention_t_op.register_fake(_attention_shape)


LAYER_BUFFER = "hf_paged_layer_idx"


def register_layer_indices(model: torch.nn.Module) -> None:
    """Give every module with an int layer_idx a non-persistent CPU buffer holding it (see the
    compiled path of paged_attention_forward); never saved in the state_dict."""
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and LAYER_BUFFER not in module._buffers:
            module.register_buffer(LAYER_BUFFER, torch.tensor(idx), persistent=False)


def remove_layer_indices(model: torch.nn.Module) -> None:
    for module in model.modules():
        module._buffers.pop(LAYER_BUFFER, None)


def paged_mask(*args, **kwargs):
    """Inside an engine step the block tables are the mask: build none. Outside, sdpa's mask."""
    if in_engine_step():
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask)
