"""Lower bound on a workload's run time: bytes moved / bandwidth vs FLOPs / peak compute.

Per decode step the weights are read once for the whole batch, and each sequence reads its KV
cache; prefill is matmul FLOPs. The bound assumes the engine's concurrency (max_num_seqs) is kept
full: steps = max(longest output, total output / concurrency). Embedding gathers, norms and
activations are ignored (small next to the matmuls and the KV reads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .workloads import Workload


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float | None  # bytes/s
    flops: float | None  # FLOP/s at the run's dtype

    @property
    def known(self) -> bool:
        return bool(self.bandwidth and self.flops)


# Measured on the H200 (2026-11-29): ~4.2 TB/s device copy, ~775 TFLOP/s bf16 dense matmul.
H200 = Hardware("NVIDIA H200", 4.2e12, 775e12)


def detect_hardware(
    device: torch.device, cpu_bandwidth_gbs: float | None = None, cpu_tflops: float | None = None
) -> Hardware:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return H200 if "H200" in name else Hardware(name, None, None)
    import os

    name = f"CPU ({os.cpu_count()} cores, torch {torch.__version__})"
    bw = cpu_bandwidth_gbs * 1e9 if cpu_bandwidth_gbs else None
    fl = cpu_tflops * 1e12 if cpu_tflops else None
    return Hardware(name, bw, fl)


@dataclass(frozen=True)
class ModelCosts:
    linear_params: int  # matmul weights, lm_head included (tied or not)
    weight_bytes: int  # bytes of those weights, read once per step
    lm_head_params: int
    kv_bytes_per_token: int  # all layers, K and V
    attn_flops_per_ctx_token: int  # per query token per context token: QK^T and PV, all layers


def model_costs(model: torch.nn.Module) -> ModelCosts:
    seen: set[int] = set()  # a tied lm_head is the embedding's Parameter object: count it once
    params = nbytes = 0
    for mod in model.modules():
        # nn.Linear and what stands in its place (the engine's fused q/k/v and gate/up slices,
        # FP8 weights, bitsandbytes' packed 4-bit / 8-bit): parameters by the layer's shape,
        # bytes as stored (with their scales)
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor) or not hasattr(mod, "in_features"):
            continue
        if isinstance(mod, torch.nn.Embedding) or id(weight) in seen:
            continue
        seen.add(id(weight))
        params += mod.in_features * mod.out_features
        nbytes += weight.numel() * weight.element_size()
        scale = getattr(mod, "weight_scale", None)
        if isinstance(scale, torch.Tensor):
            nbytes += scale.numel() * scale.element_size()
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    return ModelCosts(params, nbytes, cfg.vocab_size * cfg.hidden_size, kv, attn)


def workload_bound(costs: ModelCosts, wl: Workload, concurrency: int, hw: Hardware) -> dict:
    outs = [r.max_new_tokens for r in wl.requests]
    prompts = [len(r.prompt_token_ids) for r in wl.requests]
    conc = 1 if wl.max_concurrency == 1 else max(1, concurrency)
    # The first output token comes from the prefill step; the remaining ones need decode steps.
    steps = max(max(outs), math.ceil(sum(outs) / conc)) + (len(outs) if conc == 1 else 0)
    kv_read = sum(o * p + o * (o - 1) // 2 for p, o in zip(prompts, outs))
    kv_written = sum(p + o for p, o in zip(prompts, outs))
    nbytes = steps * costs.weight_bytes + (kv_read + kv_written) * costs.kv_bytes_per_token
    tokens = sum(prompts) + sum(outs)
    body = costs.linear_params - costs.lm_head_params  # lm_head: once per sampled token only
    flops = 2 * body * tokens + 2 * costs.lm_head_params * sum(outs)
    flops += costs.attn_flops_per_ctx_token * (kv_read + sum(p * p // 2 for p in prompts))
    result = {"bytes": nbytes, "flops": flops, "steps": steps, "hardware": hw.name}
    if not hw.known:
        return result | {"time_s": None, "output_tok_s": None, "bound_by": None}
    mem_t, comp_t = nbytes / hw.bandwidth, flops / hw.flops
    t = max(mem_t, comp_t)
    return result | {
        "time_s": t,
        "memory_s": mem_t,
        "compute_s": comp_t,
        "output_tok_s": sum(outs) / t,
        "bound_by": "memory" if mem_t >= comp_t else "compute",
    }
