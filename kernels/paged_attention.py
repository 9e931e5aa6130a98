"""Paged attention over a flat batch that mixes prefill chunks and decodes.

One entry point, `paged_attention`, for any step's batch: sequence i owns the new tokens
query_start_loc[i]:query_start_loc[i+1], which are the last q_len tokens of its seq_len; each
attends causally to the new tokens and fully to its cached prefix (optionally within a sliding
window), reading K/V from the paged cache through its block_table row.

How the work is cut (see the kernel for details):
- A program owns one q-tile of one sequence for one KV head: BLOCK_Q query tokens x all
  QUERIES_PER_KV query heads of that KV head, packed as BLOCK_M = BLOCK_Q * G rows (token-major).
  Packing the GQA group means each K/V tile is read once for all heads that share it, and a
  decode token (BLOCK_Q = 1) still gives tl.dot the 16 rows it needs.
- Prefill-shaped tiles (BLOCK_M 128): programs map to (seq, q-tile) by a binary search over
  query_start_loc on the device (no host sync; the grid is sized from host ints:
  T // BLOCK_Q + num_seqs). Decode-shaped tiles (BLOCK_M 16): program = sequence. A batch whose
  queries all fit a decode tile is one decode launch; a mixed batch is a prefill launch that
  skips the short queries plus a decode launch that takes only them.
- The KV loop is split into masked edge tiles and unmasked interior tiles, so the causal / window
  masks cost nothing on the bulk of a long context.
- Flash-decoding: for few, long decodes the KV range is also split across programs (grid axis 2),
  each writing a partial (output, log-sum-exp) to a float32 workspace; a reduce kernel combines.
- Tokens no sequence owns (past query_start_loc[-1], e.g. bucket padding) get zeros, so every
  output element is written.
All cache address arithmetic is int64: block_id * block stride passes 2^31 on large caches.

Where the pieces live: this module holds the entry point, its argument checks, the pure-torch
reference and the launch logic; kernels/paged_attention_kernel.py the Triton kernel;
kernels/attention_common.py the online-softmax step it shares with kernels/decode_attention.py;
kernels/split_kv_reduce.py the flash-decoding workspace and reduce; kernels/attention_config.py
the tile shapes and split counts.
"""

from __future__ import annotations

import torch

from hf_paged.worker.forward_context import AttentionMetadata

from .attention_config import AttentionConfig, choose_num_kv_splits, decode_config, prefill_config
from .host_math import cdiv, next_power_of_2
from .kv_write import FP8_MAX, check_kv_cache_pair, check_kv_scales, check_launchable
from .paged_attention_kernel import _paged_attention_kernel
from .split_kv_reduce import _reduce_splits, _split_workspace

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HEAD_DIMS_MAX = 256
# Flat tokens each zero-fill program clears (the kernel's ZERO_TOKENS).
_ZERO_TOKENS = 64


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, Dk]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]: a per-head logit in the softmax denominator
    k_scale: float = 1.0,  # FP8 caches: a key is k_scale * its stored value
    v_scale: float = 1.0,
    alibi_slopes: torch.Tensor | None = None,  # [Hq]: ALiBi, slope * (key pos - query pos)
) -> torch.Tensor:  # [T, Hq, Dv]
    """Pure-torch reference (and the CPU backend). One sequence at a time, softmax in float32
    (float64 for a float64 model: a downcast there showed as a 6e-6 relative mismatch against
    transformers on Gemma 4, whose unscaled attention logits reach ~60).

    Semantics (the contract every kernel must match): the new tokens of sequence i are the last
    q_len of its seq_len tokens; new token at absolute position p attends to keys k <= p, and with
    a sliding window W only to keys k > p - W (W tokens including itself, as transformers does).
    Softcapping applies cap * tanh(score / cap) to the scaled scores before masking.
    Attention sinks (gpt-oss's s_aux) join the softmax as one more logit per query head, with a
    value of zeros: weights exp(s_j) / (sum_k exp(s_k) + exp(sink)), as transformers' eager
    attention computes them by concatenating the sink column and dropping it after the softmax.
    ALiBi (Bloom, MPT, Falcon's ALiBi variant) adds slope_h * (key pos - query pos) to head h's
    scaled (and capped) scores; the models add slope_h * key pos, the same softmax.
    Tokens that no sequence owns (past query_start_loc[-1]) get zeros. Values may be narrower
    or wider than keys (Dv != Dk: MLA models unabsorbed); the output has the values' width.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    head_dim_v = value_cache.shape[3]
    group = num_q_heads // num_kv_heads
    acc = torch.promote_types(query.dtype, torch.float32)
    # zeros, not empty: rows no sequence owns (bucket padding) must not carry garbage/NaN onward
    out = query.new_zeros(num_tokens, num_q_heads, head_dim_v)
    qsl = meta.query_start_loc_host or meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_host or meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_table[i, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].to(acc) * k_scale
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim_v)[:seq_len].to(acc) * v_scale
        q = query[start:end].to(acc)
        # [Hkv, G, q_len, D] x [Hkv, D, seq_len] -> [Hkv, G, q_len, seq_len]
        q = q.reshape(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(q, k.permute(1, 2, 0).unsqueeze(1)) * scale
        if softcap is not None and softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        if alibi_slopes is not None:
            slopes = alibi_slopes.to(acc).reshape(num_kv_heads, group, 1, 1)
            scores = scores + slopes * (k_pos - q_pos).to(acc)
        allowed = k_pos <= q_pos
        if sliding_window is not None and sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.to(acc).reshape(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))  # [Hkv, G, q_len, Dv]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, -1).to(out.dtype)
    return out


def sinks_for_kernel(
    sinks: torch.Tensor | None, query: torch.Tensor, name: str = "sinks"
) -> torch.Tensor | None:
    """Per-query-head values (attention sinks, ALiBi slopes: `name`) checked against the
    query's heads, as the kernels read them: float32, contiguous (a no-op for gpt-oss-style
    float32 parameters)."""
    if sinks is None:
        return None
    num_q_heads = query.shape[1]
    if sinks.dim() != 1 or sinks.shape[0] != num_q_heads:
        raise ValueError(
            f"{name} must be [num_q_heads={num_q_heads}], one value per query head, got "
            f"{tuple(sinks.shape)}"
        )
    if not sinks.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {sinks.dtype}")
    if sinks.device != query.device:
        raise ValueError(f"{name} is on {sinks.device}, query on {query.device}")
    return sinks.to(torch.float32).contiguous()


def _check_attention_args(query, key_cache, value_cache, meta, out) -> None:
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}"
        )
    check_kv_cache_pair(key_cache, value_cache, same_head_dim=False)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_head_dim = key_cache.shape
    head_dim_v = value_cache.shape[3]
    if kv_head_dim != head_dim:
        raise ValueError(f"key_cache head_dim {kv_head_dim} != query head_dim {head_dim}")
    if head_dim > _HEAD_DIMS_MAX or head_dim < 16:
        raise ValueError(f"query head_dim must be in [16, {_HEAD_DIMS_MAX}], got {head_dim}")
    if head_dim_v > _HEAD_DIMS_MAX or head_dim_v < 16:
        raise ValueError(
            f"value_cache head_dim must be in [16, {_HEAD_DIMS_MAX}], got {head_dim_v}"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of key_cache kv heads ({num_kv_heads})"
        )
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"key_cache block_size must be a power of 2, got {block_size}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query dtype must be float32/float16/bfloat16, got {query.dtype}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype != query.dtype and t.dtype not in FP8_MAX:
            raise ValueError(
                f"{name} dtype {t.dtype} != query dtype {query.dtype} (and not an FP8 cache)"
            )
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} != key_cache's {key_cache.dtype}")
    tensors = [("query", query), ("key_cache", key_cache), ("value_cache", value_cache)]
    if out is not None:
        if tuple(out.shape) != (num_tokens, num_q_heads, head_dim_v):
            raise ValueError(
                f"out shape {tuple(out.shape)} != (num_tokens, num_q_heads, value head_dim) "
                f"{(num_tokens, num_q_heads, head_dim_v)}"
            )
        if out.dtype != query.dtype:
            raise ValueError(f"out dtype {out.dtype} != query dtype {query.dtype}")
        tensors.append(("out", out))
    for name, t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in head_dim (stride(-1) == 1), got strides {t.stride()}"
            )
    num_seqs = meta.seq_lens.shape[0] if meta.seq_lens.dim() == 1 else -1
    int_specs = (
        ("meta.query_start_loc", meta.query_start_loc, (num_seqs + 1,)),
        ("meta.seq_lens", meta.seq_lens, (num_seqs,)),
    )
    for name, t, shape in int_specs:
        if t.dim() != 1 or tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} (num_seqs={num_seqs}), got {tuple(t.shape)}"
            )
    bt = meta.block_table
    if bt.dim() != 2 or bt.shape[0] != num_seqs:
        raise ValueError(
            f"meta.block_table must be [num_seqs={num_seqs}, max_blocks], got {tuple(bt.shape)}"
        )
    if bt.shape[1] > 0 and bt.stride(1) != 1:
        raise ValueError(f"meta.block_table must be contiguous along blocks, strides {bt.stride()}")
    for name, t in (
        ("meta.query_start_loc", meta.query_start_loc),
        ("meta.seq_lens", meta.seq_lens),
        ("meta.block_table", bt),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if not t.is_contiguous() and t.dim() == 1:
            raise ValueError(f"{name} must be contiguous")
        tensors.append((name, t))
    for name, t in tensors:
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    check_launchable(query, "query")


def paged_attention(
    query: torch.Tensor,  # [T, Hq, Dk]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dk]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, Dv], written in full
    *,
    sinks: torch.Tensor | None = None,  # [Hq], any float dtype: attention sinks (s_aux)
    alibi_slopes: torch.Tensor | None = None,  # [Hq], any float dtype: ALiBi slopes
    num_kv_splits: int | None = None,
    config: AttentionConfig | None = None,
    pdl: bool = False,
    k_scale: float = 1.0,  # FP8 caches: a key is k_scale * its stored value
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Triton paged attention; same semantics as `paged_attention_ref`.

    meta.max_query_len must be >= every sequence's query length (it selects the decode path,
    which gives each sequence a single q-tile) and meta.max_seq_len >= every seq_len (it sizes
    the flash-decoding split). Batches whose every query fits a decode tile run as one launch
    (plus the split reduce); other batches run prefill-shaped tiles for the long queries and,
    unless meta.min_query_len shows there are none, a decode-shaped launch for the short
    ones (a decode token in a 128-row prefill tile would waste 32x the tensor-core work).
    num_kv_splits overrides the flash-decoding split of decode-only batches (a CUDA graph should
    fix it at capture: it sets the grid); config forces one launch with that tile shape.
    pdl (Hopper, compiled kernels only): launch with programmatic dependent launch, so the
    kernel after this one may be scheduled (and prefetch its weights) while attention runs.
    """
    _check_attention_args(query, key_cache, value_cache, meta, out)
    check_kv_scales(k_scale, v_scale)
    sinks = sinks_for_kernel(sinks, query)
    # FP8 caches are dequantised inside the kernel: loaded K/V rows are cast to the query's
    # dtype, k_scale joins the softmax scale (q.(s k) = s (q.k), before any softcap) and
    # v_scale the final normalisation (sum_j p_j s v_j = s sum_j p_j v_j).
    scale = (float(scale) * k_scale, float(v_scale))
    alibi = sinks_for_kernel(alibi_slopes, query, "alibi_slopes")
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, head_dim_v = key_cache.shape[2], value_cache.shape[3]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = query.new_empty(num_tokens, num_q_heads, head_dim_v)
    if num_tokens == 0:
        return out
    # tiles sized for the wider of a key and a value head (registers hold both rows)
    head_dim = max(head_dim, head_dim_v)
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if config is not None:
        if config.block_q < 1 or config.block_m < config.block_q * group:
            raise ValueError(f"config {config} cannot hold {group} query heads per kv head")
        _launch(
            query,
            key_cache,
            value_cache,
            meta,
            scale,
            sliding_window,
            softcap,
            sinks,
            alibi,
            out,
            config,
            num_kv_splits or 1,
            q_filter=0,
            short_q=0,
            zero_fill=True,
            pdl=pdl,
        )
        return out

    dec = decode_config(group, head_dim)
    if meta.max_query_len <= dec.block_q:  # decode-only (or short speculative verifies)
        splits = num_kv_splits or choose_num_kv_splits(
            meta.seq_lens.shape[0], num_kv_heads, meta.max_seq_len, query.device
        )
        _launch(
            query,
            key_cache,
            value_cache,
            meta,
            scale,
            sliding_window,
            softcap,
            sinks,
            alibi,
            out,
            dec,
            splits,
            q_filter=0,
            short_q=0,
            zero_fill=True,
            pdl=pdl,
        )
        return out

    pre = prefill_config(group, head_dim, query.dtype)
    # once per step on the host (AttentionMetadata.min_query_len), not once per layer here
    has_short = meta.min_query_len is None or meta.min_query_len <= dec.block_q
    _launch(
        query,
        key_cache,
        value_cache,
        meta,
        scale,
        sliding_window,
        softcap,
        sinks,
        alibi,
        out,
        pre,
        1,
        q_filter=2 if has_short else 0,
        short_q=dec.block_q,
        zero_fill=True,
        pdl=pdl,
    )
    if has_short:
        # no split here: the reduce runs per token and would clobber the prefill rows
        _launch(
            query,
            key_cache,
            value_cache,
            meta,
            scale,
            sliding_window,
            softcap,
            sinks,
            alibi,
            out,
            dec,
            1,
            q_filter=1,
            short_q=dec.block_q,
            zero_fill=False,
            pdl=pdl,
        )
    return out


def _launch(
    query,
    key_cache,
    value_cache,
    meta,
    scale,
    sliding_window,
    softcap,
    sinks,
    alibi,
    out,
    cfg: AttentionConfig,
    num_splits: int,
    q_filter: int,
    short_q: int,
    zero_fill: bool,
    pdl: bool = False,
) -> None:
    num_tokens, _, head_dim = query.shape
    num_kv_heads, head_dim_v = key_cache.shape[2], value_cache.shape[3]
    num_seqs = meta.seq_lens.shape[0]
    if not cfg.one_tile_per_seq:
        num_splits = 1  # the reduce assumes one tile per sequence
    head_dim_v_pad = max(16, next_power_of_2(head_dim_v))
    if cfg.one_tile_per_seq:
        num_tile_programs = num_seqs
    else:
        num_tile_programs = num_tokens // cfg.block_q + num_seqs
    num_zero_programs = cdiv(num_tokens, _ZERO_TOKENS) if zero_fill else 0
    grid = (num_tile_programs + num_zero_programs, num_kv_heads, num_splits)
    if grid[0] == 0:
        return
    split = num_splits > 1
    ws_o, ws_lse = _split_workspace(query, out, num_splits, head_dim_v_pad)
    args, kwargs = _shared_launch_args(
        query, key_cache, value_cache, meta, out, ws_o, ws_lse, num_splits, scale,
        sliding_window, softcap, sinks, cfg, pdl,
    )  # fmt: skip
    _paged_attention_kernel[grid](
        out,
        ws_o,
        ws_lse,
        query,
        key_cache,
        value_cache,
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        num_seqs,
        num_tokens,
        num_tile_programs,
        num_splits,
        *args,
        BLOCK_Q=cfg.block_q,
        ZERO_TOKENS=_ZERO_TOKENS,
        ONE_TILE_PER_SEQ=cfg.one_tile_per_seq,
        Q_FILTER=q_filter,
        SHORT_Q=short_q,
        alibi_ptr=alibi,  # None when off: never read
        ALIBI=alibi is not None,
        **kwargs,
    )
    if split:
        _reduce_splits(out, ws_o, ws_lse, meta, num_splits, head_dim_v, head_dim_v_pad, pdl)


def _shared_launch_args(
    query, key_cache, value_cache, meta, out, ws_o, ws_lse, num_splits, scale,
    sliding_window, softcap, sinks, cfg: AttentionConfig, pdl: bool,
):  # fmt: skip
    """What both attention kernels (paged_attention_kernel's, decode_attention's) take alike: the
    positional run from the sinks pointer to the workspace strides, then the shared constexprs
    and launch options. scale: the softmax scale, or (softmax scale with k_scale folded in,
    v_scale) for an FP8 cache."""
    head_dim, head_dim_v = query.shape[2], value_cache.shape[3]
    sliding = sliding_window is not None and sliding_window > 0
    capped = softcap is not None and softcap > 0
    split = num_splits > 1
    # Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits: upcast there
    # (after the same bf16 rounding of P), so CPU CI checks the arithmetic the GPU does.
    upcast = query.dtype == torch.bfloat16 and query.device.type == "cpu"
    scale, out_scale = scale if isinstance(scale, tuple) else (float(scale), 1.0)
    args = (
        query if sinks is None else sinks,  # any pointer when SINKS is off: never read
        float(scale),
        float(out_scale),
        float(softcap) if capped else 1.0,
        int(sliding_window) if sliding else 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        meta.block_table.stride(0),
        ws_o.stride(0),
        ws_o.stride(1),
        ws_o.stride(2) if split else 0,
        ws_lse.stride(0),
        ws_lse.stride(1),
    )
    kwargs = dict(
        QUERIES_PER_KV=query.shape[1] // key_cache.shape[2],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)),
        # a value head's width: the same constexprs when K and V agree (the usual variants
        # compile as before); MLA's narrower values get their own tile width
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=max(16, next_power_of_2(head_dim_v)),
        PAGE_SIZE=key_cache.shape[1],
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SPLIT=split,
        SLIDING=sliding,
        SOFTCAP=capped,
        SINKS=sinks is not None,
        # float32 inputs: true fp32 products (tf32 would cost ~1e-3 relative error).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if pdl:
        kwargs["launch_pdl"] = True
    return args, kwargs
