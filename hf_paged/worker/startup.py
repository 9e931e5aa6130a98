"""What the model runner does once at start-up: KV-cache geometry and sizing (a profiling forward
at the full token budget on CUDA), a warm-up of every attention-kernel variant, and the capture
of the CUDA graphs."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from hf_paged.config import EngineConfig
from hf_paged.worker.compile_ahead import CompileAhead, warm_marker
from hf_paged.worker.forward_context import AttentionMetadata, ForwardContext, forward_context
from hf_paged.worker.graph_blockers import graph_blocker
from hf_paged.worker.startup_times import StartupTimes


@dataclass(frozen=True, slots=True)
class LayerKVShape:
    """One layer's cache rows: K/V heads, and the widths of a key and a value head. They differ
    where the model computes them so (MLA models as transformers runs them, unabsorbed:
    DeepSeek-V2/V3 keys of 192, values of 128) and from layer to layer in some (MiMo-V2's
    sliding-window layers have twice the KV heads)."""

    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int


class KVCacheSpec:
    """Per-layer KV geometry: what the model's attention calls pass (one probe forward of two
    tokens, read by the attention function), else the text config's one geometry for all."""

    def __init__(self, model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> None:
        cfg = model.config.get_text_config()
        read = partial(_config_field, model, cfg)
        num_layers = read("num_hidden_layers")
        probed = probe_kv_shapes(model)
        if all(i in probed for i in range(num_layers)):
            default = None  # config fields that raise (Gemma 4's per-layer head_dim) unread
        else:
            num_heads = read("num_attention_heads")
            num_kv_heads = read("num_key_value_heads", None) or num_heads
            head_dim = read("head_dim", None) or read("hidden_size") // num_heads
            default = LayerKVShape(num_kv_heads, head_dim, head_dim)
        num_layers = max(num_layers, max(probed, default=-1) + 1)
        self.layers = [probed.get(i, default) for i in range(num_layers)]
        self.block_size = block_size
        self.dtype = dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_slot = sum(s.num_kv_heads * (s.k_head_dim + s.v_head_dim) for s in self.layers)
        return self.block_size * per_slot * itemsize

    def allocate(
        self, num_blocks: int, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        caches = []
        for s in self.layers:
            shape = (num_blocks, self.block_size, s.num_kv_heads)
            caches.append(
                (
                    torch.zeros((*shape, s.k_head_dim), dtype=self.dtype, device=device),
                    torch.zeros((*shape, s.v_head_dim), dtype=self.dtype, device=device),
                )
            )
        return caches


# Tokens in the probe forward: past 128, so that attention over compressed entries (DeepSeek-V4
# compresses every 128 tokens into one, and every 4 in its other layer type) shows as more keys
# than queries; one short forward at start-up.
PROBE_TOKENS = 136


def probe_kv_shapes(model: torch.nn.Module) -> dict[int, LayerKVShape]:
    """layer_idx -> the K/V shapes its attention calls pass, from one forward of PROBE_TOKENS
    tokens through the paged attention function outside an engine step (transformers' own
    attention computes it). Empty when the model does not route attention through it or the
    forward fails: the config's geometry serves then, as it did before the probe. Raises
    ValueError for a layer that attends over more keys than the tokens it was given."""
    from hf_paged.worker.attention import recording_kv_shapes

    cfg = model.config.get_text_config()
    length = min(PROBE_TOKENS, getattr(cfg, "max_position_embeddings", None) or PROBE_TOKENS)
    vocab = getattr(cfg, "vocab_size", None) or 4
    try:
        device = next(model.parameters()).device
        ids = (torch.arange(length, device=device) % (vocab - 3) + 3)[None]
        with recording_kv_shapes() as shapes, torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    except Exception:
        return {}
    extra = {i: s[3] for i, s in shapes.items() if s[3] != 0}
    if extra:
        layer, n = min(extra.items())
        raise ValueError(
            f"model: {type(model).__name__}: layer {layer}'s attention takes {n} more keys than "
            f"its {length} tokens (compressed, memory or otherwise extra KV entries); the paged "
            "cache holds one K/V row per token, so this attention is not supported"
        )
    return {i: LayerKVShape(*s[:3]) for i, s in shapes.items()}


def _config_field(model: torch.nn.Module, cfg, name: str, *default):
    """A KV geometry field of the text config, read only for layers the probe did not see (the
    config's geometry then serves every such layer): a config whose field varies by layer
    (Gemma 4's head_dim, where global_head_dim differs) raises from transformers here, refused
    with the field's name rather than its RuntimeError."""
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
            f"every layer ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}), and a "
            "forward through the paged attention function did not show each layer's K/V shapes"
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
def warm_up_kernels(
    forward, kv_caches, backend, cfg: EngineConfig, device: torch.device, lora: bool = False
) -> None:
    """Run the attention-kernel variants a run can meet (mixed prefill + decode, decode with
    and without the flash-decoding split, short and long contexts) once now. Triton compiles
    a variant on first use, ~1 s each for the paged kernel on the H200: without this, the
    first mixed steps of a run pay for it. Nothing is written (slots -1); logits are unused.
    With LoRA layers, each shape runs again with every token on adapter slot 0 (and a prefill
    past 256 tokens, the LoRA kernels' larger token tile): the shrink/expand variants compile
    here, not inside the first adapter requests."""
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
    if lora:
        shapes += (([300], [300]),)
    for q_lens, seq_lens in shapes:
        width = -(-max(seq_lens) // bs)
        table = torch.zeros((len(q_lens), width), dtype=torch.int32, device=device)
        meta = AttentionMetadata.from_lengths(q_lens, seq_lens, table)
        pos = torch.cat([torch.arange(s - q, s, device=device) for q, s in zip(q_lens, seq_lens)])
        ids = torch.zeros_like(pos)
        keep = torch.tensor(np.cumsum(q_lens) - 1, device=device)
        for on_adapter in (False, True) if lora else (False,):
            ctx = ForwardContext(meta, kv_caches, backend)
            if on_adapter:
                from hf_paged.lora.batch import lora_batch

                slots = np.zeros(len(ids), dtype=np.int32)
                ctx.lora_groups = lora_batch(slots, cfg.max_loras, device)
            with forward_context(ctx):
                forward(ids, pos, keep)
    torch.cuda.synchronize(device)


def capture_graphs(runner, config: EngineConfig, times: StartupTimes):
    """On CUDA: the kernel warm-up (Triton backend), then every decode and mixed-step graph;
    returns the CudaGraphRunner, or None where graphs are off or cannot run. Both timed.

    The Triton variants both need are compiled ahead, together (worker/compile_ahead.py): one
    pass of the warm-up and of each graph bucket's forward records them without compiling or
    launching anything, a thread pool compiles them, then the warm-up and the captures run."""
    device = runner.device
    blocker = graph_blocker(runner.model) if config.cuda_graphs else None
    if blocker is not None and device.type == "cuda":
        warnings.warn(f"hf_paged: CUDA graphs off: {blocker}", RuntimeWarning, stacklevel=3)
    graphs_ok = config.cuda_graphs and runner.backend.graph_safe and blocker is None
    graphs = None
    if device.type == "cuda" and graphs_ok:
        from hf_paged.worker.cuda_graphs import CudaGraphRunner

        with times.phase("graph_capture"):  # its static buffers, pinned twins included
            graphs = CudaGraphRunner(runner)
    marker = None  # where a start-up that compiled ahead leaves its mark
    if device.type == "cuda" and runner.backend.name == "triton":
        warm_up = partial(
            warm_up_kernels, runner.forward, runner.kv_caches, runner.backend, config, device,
            runner.lora,
        )  # fmt: skip
        with times.phase("kernel_warm_up"):
            ahead = CompileAhead()
            marker = warm_marker(_variant_parts(runner, config)) if ahead.available else None
            if marker is not None and marker.exists():
                marker = None  # compiled ahead before: the on-disk cache has every variant
            if marker is not None:
                with ahead.recording():
                    warm_up()
                    if graphs is not None:
                        graphs.forward_each_bucket()
                ahead.compile()
            warm_up()  # loads the compiled variants; compiles any that failed ahead
    if graphs is not None:
        with times.phase("graph_capture"):
            graphs.capture()
        times.decode_graphs, times.mixed_graphs = len(graphs.buckets), len(graphs.token_buckets)
    if marker is not None:
        _leave(marker)
    return graphs


def _variant_parts(runner, config: EngineConfig) -> list[str]:
    """What decides the Triton variants a start-up compiles, besides the kernels' sources and
    the versions (compile_ahead.warm_marker): the model's config and dtype, the engine's
    options (plain values only), LoRA."""
    cfg = runner.model.config.get_text_config()
    options = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if isinstance(getattr(config, f.name), (bool, int, float, str, type(None)))
    }
    dtype = next(runner.model.parameters()).dtype
    return [cfg.to_json_string(use_diff=False), repr(sorted(options.items())), str(dtype),
            str(runner.lora)]  # fmt: skip


def _leave(marker) -> None:
    """Leave the marker once the start-up that compiled ahead has finished (best effort)."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass


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
