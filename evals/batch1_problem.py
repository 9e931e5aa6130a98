"""The batch-1 step that evals/batch1_tile_sweep.py, batch1_critical_path.py and batch1_trace.py
time.

TinyLlama-1.1B shape, bf16, random weights, every layer's weights distinct (1.9 GB: far over
L2, as in the model), one sequence whose context is `ctx` keys, its KV cache paged in 16-token
blocks, RoPE tables over max_model_len positions. CUDA only (the benches time CUDA graphs).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import triton
from hf_paged.kernels import decode_attention, fused_gemv, norm_qkv_rope
from hf_paged.kernels.decode_attention import decode_attention_config
from hf_paged.kernels.paged_attention import AttentionConfig, choose_decode_num_kv_splits

from hf_paged.forward_context import AttentionMetadata

HBM = 4.2e12  # bytes/s: the H200's measured copy bandwidth (shared/GPU.md)
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 5632, 32, 4, 64, 32000
PAGE = 16


@dataclass
class Batch1Problem:
    layers: list  # per layer (qkv [2560, H], o [H, H], gate_up [2I, H], down [H, I])
    lm_head: torch.Tensor
    norm_w: torch.Tensor  # one RMSNorm weight for every norm (values do not change the time)
    cos: torch.Tensor  # [max_model_len, HEAD_DIM / 2]
    sin: torch.Tensor
    caches: list  # per layer (key cache, value cache)
    meta: AttentionMetadata  # one decode token at position ctx - 1; max_seq_len max_model_len
    positions: torch.Tensor
    h0: torch.Tensor  # [1, HIDDEN]: the embedding row
    decode: AttentionConfig  # decode_attention's tile for these heads
    splits: int  # its KV split count for max_model_len, as the engine's decode graphs use it
    layer_count: int
    ctx: int
    max_model_len: int

    def weight_bytes(self, skip: set = frozenset()) -> int:
        """Weight bytes a step reads, without the sites named in skip (qkv, o, lm_head)."""
        n = 0
        for qkv, o, gate_up, down in self.layers:
            for t, site in ((qkv, "qkv"), (o, "o"), (gate_up, None), (down, None)):
                n += 0 if site in skip else t.numel() * t.element_size()
        return n + (0 if "lm_head" in skip else self.lm_head.numel() * self.lm_head.element_size())


def from_argv(argv: list[str]) -> tuple[dict, Batch1Problem]:
    """key=value options; layers= (22), ctx= (256) and max_model_len= (2048) build the problem."""
    opts = dict(arg.split("=") for arg in argv)
    layers = int(opts.get("layers", 22))
    ctx = int(opts.get("ctx", 256))
    return opts, build(layers, ctx, int(opts.get("max_model_len", 2048)))


def build(layers: int, ctx: int, max_model_len: int, device: str = "cuda") -> Batch1Problem:
    dev = torch.device(device)
    torch.manual_seed(0)
    bf = torch.bfloat16
    qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM

    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=bf) * 0.02

    ws = [(w(qkv_n, HIDDEN), w(HIDDEN, HIDDEN), w(2 * INTER, HIDDEN), w(HIDDEN, INTER))]
    ws += [tuple(w(*t.shape) for t in ws[0]) for _ in range(layers - 1)]
    half = HEAD_DIM // 2
    pos = torch.arange(max_model_len, device=dev, dtype=torch.float32)[:, None]
    freqs = pos / (10000 ** (torch.arange(half, device=dev) / half))
    blocks = triton.cdiv(ctx, PAGE)

    def cache():
        return torch.randn(blocks + 1, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=bf)

    table = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
    meta = AttentionMetadata.from_lengths([1], [ctx], table)
    meta.slot_mapping.fill_(ctx - 1)
    meta.max_seq_len = max_model_len  # as the engine's decode graphs are captured
    dec = decode_attention_config(HEADS // KV_HEADS, HEAD_DIM)  # the engine's default tile
    return Batch1Problem(
        layers=ws,
        lm_head=w(VOCAB, HIDDEN),
        norm_w=torch.rand(HIDDEN, device=dev, dtype=bf) + 0.5,
        cos=freqs.cos().to(bf),
        sin=freqs.sin().to(bf),
        caches=[(cache(), cache()) for _ in range(layers)],
        meta=meta,
        positions=torch.full((1,), ctx - 1, device=dev, dtype=torch.int64),
        h0=torch.randn(1, HIDDEN, device=dev, dtype=bf),
        decode=dec,
        splits=choose_decode_num_kv_splits(1, KV_HEADS, max_model_len, dec.block_n, dev),
        layer_count=layers,
        ctx=ctx,
        max_model_len=max_model_len,
    )


def run_step(p: Batch1Problem, before_layer=None) -> None:
    """The small-batch forward's default batch-1 launch sequence, PDL on: per layer
    norm_qkv_rope, decode_attention (+ its split reduce), o + residual, norm + gate/up +
    SiLU-mul, down + residual; then final norm + lm_head. before_layer(i) runs first for each
    layer i (batch1_trace.py arms its buffers there)."""
    h, nw = p.h0, p.norm_w
    for i, ((qkv, o, gate_up, down), (kc, vc)) in enumerate(zip(p.layers, p.caches)):
        if before_layer is not None:
            before_layer(i)
        q = norm_qkv_rope(
            h, qkv, None, nw, 1e-5, p.positions, p.cos, p.sin, kc, vc, p.meta.slot_mapping,
            HEADS, pdl=True,
        )  # fmt: skip
        a = decode_attention(q, kc, vc, p.meta, HEAD_DIM**-0.5, pdl=True)
        h = fused_gemv(a.view(1, -1), o, residual=h, pdl=True)
        act = fused_gemv(h, gate_up[:INTER], up_weight=gate_up[INTER:], norm_weight=nw,
                         eps=1e-5, pdl=True)  # fmt: skip
        h = fused_gemv(act, down, residual=h, pdl=True)
    fused_gemv(h, p.lm_head, norm_weight=nw, eps=1e-5, pdl=True)


def timed_graph(fn) -> float:
    """Seconds per CUDA-graph replay of fn: evals/kernels.py's bench_graph (median, L2 flushed)."""
    return importlib.import_module("hf_paged_evals.kernels").bench_graph(fn) / 1e3
