"""What the model runner does once at start-up: KV-cache geometry and sizing (a profiling forward
at the full token budget on CUDA), and a warm-up of every attention-kernel variant."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from hf_paged.config import EngineConfig
from hf_paged.worker.forward_context import AttentionMetadata, ForwardContext, forward_context


class KVCacheSpec:
    """Per-layer KV geometry read from the model config."""

    def __init__(self, model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> None:
        cfg = model.config.get_text_config()
        read = partial(_config_field, model, cfg)
        self.num_layers = read("num_hidden_layers")
        num_heads = read("num_attention_heads")
        self.num_kv_heads = read("num_key_value_heads", None) or num_heads
        self.head_dim = read("head_dim", None) or read("hidden_size") // num_heads
        self.block_size = block_size
        self.dtype = dtype

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def allocate(
        self, num_blocks: int, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in range(self.num_layers)
        ]


def _config_field(model: torch.nn.Module, cfg, name: str, *default):
    """A KV geometry field of the text config. One geometry serves every layer: a config whose
    field varies by layer (Gemma 4's head_dim, where global_head_dim differs) raises from
    transformers here, refused with the field's name rather than its RuntimeError."""
    try:
        return getattr(cfg, name, *default)
    except AttributeError:
        raise ValueError(
            f"model: {type(model).__name__} has no {name} in its config: the paged KV cache "
            "cannot be sized"
        ) from None
    except Exception as exc:
        raise ValueError(
            f"model: {type(model).__name__}: its config's {name} cannot be read as one value for "
            f"every layer ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); the paged KV "
            "cache has one geometry for all layers, so per-layer KV shapes are not supported yet"
        ) from exc


def determine_num_blocks(
    cfg: EngineConfig,
    spec: KVCacheSpec,
    device: torch.device,
    forward,
    backend,
    reserved_bytes_per_block: int = 0,
) -> int:
    """KV blocks: the configured number, a CPU budget, or what a CUDA profiling forward leaves
    (forward: the runner's ModelForward; backend: its attention backend). A block costs the
    model's KV plus reserved_bytes_per_block (a draft model's KV in the same block ids)."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    per_block = spec.bytes_per_block + reserved_bytes_per_block
    blocks_per_seq = -(-cfg.max_model_len // spec.block_size)
    if device.type != "cuda":
        # Enough for max_num_seqs full-length sequences, within cpu_kv_cache_bytes.
        return max(1, min(cfg.cpu_kv_cache_bytes // per_block, cfg.max_num_seqs * blocks_per_seq))
    return _profile_cuda_num_blocks(cfg, spec, device, forward, backend, per_block)


@torch.inference_mode()
def _profile_cuda_num_blocks(
    cfg: EngineConfig, spec: KVCacheSpec, device, forward, backend, per_block: int
) -> int:
    """Run one forward at the full token budget with a scratch cache, measure peak memory, and
    give the KV cache what remains of gpu_memory_utilization * total memory."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = cfg.max_num_batched_tokens
    seq_len = min(num_tokens, cfg.max_model_len)
    lens = [seq_len] * (num_tokens // seq_len) + (
        [num_tokens % seq_len] if num_tokens % seq_len else []
    )
    scratch_blocks = sum(-(-n // spec.block_size) for n in lens)
    caches = spec.allocate(scratch_blocks, device)
    meta, positions = _profile_metadata(lens, spec.block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    keep = torch.arange(max(0, num_tokens - cfg.max_num_seqs), num_tokens, device=device)
    with torch.inference_mode(), forward_context(ForwardContext(meta, caches, backend)):
        logits = forward(ids, positions, keep)
        logits.float().softmax(-1)  # the sampler's working set
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    kv_bytes = int(total * cfg.gpu_memory_utilization) - peak - non_torch
    num_blocks = kv_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves no memory for the KV "
            f"cache (peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB); raise it or "
            "lower max_num_batched_tokens"
        )
    return int(num_blocks)


@torch.inference_mode()
def warm_up_kernels(forward, kv_caches, backend, cfg: EngineConfig, device: torch.device) -> None:
    """Run the attention-kernel variants a run can meet (mixed prefill + decode, decode with
    and without the flash-decoding split, short and long contexts) once now. Triton compiles
    a variant on first use, ~1 s each for the paged kernel on the H200: without this, the
    first mixed steps of a run pay for it. Nothing is written (slots -1); logits are unused."""
    bs = cfg.block_size
    long = min(cfg.max_model_len, 4096)
    shapes = (
        ([64], [64]),  # prefill only (no short query: its own variant; a lone first prompt)
        ([64, 1], [64, 8]),  # mixed: a prefill tile and a decode tile, short context
        ([64, 1, 1], [long, long, 9]),  # mixed, long context
        ([1], [8]),  # decode, no split
        ([1], [long]),  # decode, split KV
        ([1, 1], [long, 9]),
    )
    if forward.small_batch is not None:  # its kernels compile per power-of-2 row count
        most = forward.small_batch.max_rows
        for rows in (4, 8):  # 1 and 2 rows: the decode shapes above
            if most > rows // 2:
                shapes += (([1] * min(rows, most), [8] * min(rows, most)),)
        # the decode shapes above ran its decode_attention: decodes of more sequences run
        # transformers' forward and the general kernel's decode tiles, split and not
        over = most + 1
        shapes += (([1] * over, [long] * over), ([1] * over, [8] * over))
    for q_lens, seq_lens in shapes:
        width = -(-max(seq_lens) // bs)
        table = torch.zeros((len(q_lens), width), dtype=torch.int32, device=device)
        meta = AttentionMetadata.from_lengths(q_lens, seq_lens, table)
        pos = torch.cat([torch.arange(s - q, s, device=device) for q, s in zip(q_lens, seq_lens)])
        ids = torch.zeros_like(pos)
        keep = torch.tensor(np.cumsum(q_lens) - 1, device=device)
        with forward_context(ForwardContext(meta, kv_caches, backend)):
            forward(ids, pos, keep)
    torch.cuda.synchronize(device)


def _profile_metadata(lens: list[int], block_size: int, device: torch.device):
    max_blocks = max(-(-n // block_size) for n in lens)
    block_table = np.zeros((len(lens), max_blocks), dtype=np.int64)
    positions, slots, next_block = [], [], 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        block_table[i, :nb] = np.arange(next_block, next_block + nb)
        next_block += nb
        pos = np.arange(n)
        positions.append(pos)
        slots.append(block_table[i, pos // block_size] * block_size + pos % block_size)
    table = torch.from_numpy(block_table.astype(np.int32)).to(device)
    meta = AttentionMetadata.from_lengths(lens, lens, table)
    meta.slot_mapping = torch.from_numpy(np.concatenate(slots)).to(device)  # write, as steps do
    return meta, torch.from_numpy(np.concatenate(positions)).to(device)
