"""Tensor-parallel sharding of a transformers model, in place, for one rank of N.

The modules to split come from transformers' own tensor-parallel plan (`model._tp_plan`, built
from `config.base_model_tp_plan` and the class's head plan):

- "colwise" (q/k/v, gate/up): each rank keeps a slice of the output rows (whole attention heads;
  its part of the MLP's intermediate size). Fused later per rank (integrations/fused_projections).
- "rowwise" (o_proj, down_proj): each rank keeps the matching slice of the input columns; its
  partial output is summed over the ranks by an all-reduce right after the layer (a forward hook),
  so the residual stream is whole on every rank.
- "colwise_gather_output" (lm_head): a slice of the vocabulary per rank, gathered after the layer
  (every rank gets the full logits rows; rank 0 samples). A vocabulary that does not split evenly
  keeps lm_head whole on every rank.
- "embedding_rowwise": the embedding stays whole on every rank (no collective; exact).

KV heads: split by rank when num_key_value_heads is a multiple of N; with fewer KV heads than
ranks (N a multiple of num_key_value_heads) each KV head is replicated on the N / num_kv ranks
whose query heads read it. The paged KV cache of a rank then holds that rank's KV heads only (its
geometry is probed from the sharded model). Anything else is refused with a ValueError naming
the field.

On rank 0 the user's model is sharded in place and put back by `ShardedModel.restore` (the
original parameters are kept, so nothing is lost); the other ranks shard a skeleton built on the
meta device and receive their tensors from rank 0 (executor.py).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from hf_paged.distributed import collectives

COLWISE, ROWWISE = "colwise", "rowwise"
GATHER = "colwise_gather_output"
REPLICATED = ("embedding_rowwise",)  # kept whole on every rank
STYLES = (COLWISE, ROWWISE, GATHER, *REPLICATED)
# attention module attributes that count heads (set to the rank's counts, put back on restore)
HEAD_ATTRS = ("num_heads", "num_attention_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads")
KV_PROJ = ("k_proj", "v_proj")
# The layers whose layout the split relies on (whole heads in output rows; the MLP's
# intermediate size): a plan entry of another name (a fused qkv, a layout of its own) is refused
# rather than split by rows whose meaning is unknown.
LEAVES = {
    COLWISE: ("q_proj", *KV_PROJ, "gate_proj", "up_proj"),
    ROWWISE: ("o_proj", "down_proj"),
    GATHER: ("lm_head",),
}


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Module-name pattern -> style, from transformers' plan for this model."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:  # an older layout: the config's base-model plan under the base model's prefix
        base = getattr(model.config.get_text_config(), "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        plan = {(f"{prefix}.{k}" if prefix else k): v for k, v in base.items()}
    if not plan:
        raise ValueError(
            f"tensor_parallel_size: model {type(model).__name__} has no tensor-parallel plan "
            "(its config has no base_model_tp_plan), so hf_paged cannot tell which layers to split"
        )
    return plan


def _head_counts(model: nn.Module) -> tuple[int, int, int]:
    cfg = model.config.get_text_config()
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise ValueError("tensor_parallel_size: the model config has no num_attention_heads")
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, kv_heads, head_dim


def check_shardable(model: nn.Module, world: int) -> dict[str, str]:
    """Refuse, with a ValueError naming the field, a model that does not split over `world`
    ranks; return {module name: style} of the modules to shard."""
    heads, kv_heads, _ = _head_counts(model)
    if heads % world:
        raise ValueError(
            f"tensor_parallel_size={world} does not divide num_attention_heads={heads}"
        )
    if kv_heads % world and world % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={world} and num_key_value_heads={kv_heads}: the KV heads "
            "must split evenly over the ranks, or the ranks evenly over the KV heads (replicated)"
        )
    cfg = model.config.get_text_config()
    inter = getattr(cfg, "intermediate_size", None)
    if isinstance(inter, int) and inter % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide intermediate_size={inter}")
    plan = tp_plan(model)
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None:
            continue
        if style not in STYLES:
            raise ValueError(
                f"tensor_parallel_size: {name} has tensor-parallel style {style!r} in the "
                f"model's plan; hf_paged splits {STYLES[:3]} layers only"
            )
        if style in REPLICATED:
            continue
        if name.rsplit(".", 1)[-1] not in LEAVES[style]:
            raise ValueError(
                f"tensor_parallel_size: {name} ({style!r} in the model's plan) is not one of the "
                f"layers hf_paged splits as {style!r}: {LEAVES[style]}"
            )
        if type(module) is not nn.Linear:  # LoRA-wrapped, quantised, fused: not a plain split
            raise ValueError(
                f"tensor_parallel_size: {name} is a {type(module).__name__}, not a plain "
                "nn.Linear; hf_paged splits plain linear layers only"
            )
        chosen[name] = style
    if not any(s == ROWWISE for s in chosen.values()):
        raise ValueError(
            f"tensor_parallel_size: no layer of {type(model).__name__} matches its plan's "
            f"row-wise entries ({sorted(plan)}): nothing to split"
        )
    return chosen


class ShardedModel:
    """What shard_model changed on one rank: each split tensor's original and its split
    (dim, parts, index of this rank), hooks, head attributes. restore() puts the model back;
    shard_of() cuts another rank's part of a tensor (rank 0 sends the other ranks theirs)."""

    def __init__(self, model: nn.Module, rank: int, world: int) -> None:
        self.model, self.rank, self.world = model, rank, world
        # (module, attribute) -> (original tensor, dim, parts, rank -> index); dim None: bias
        # zeroed on ranks other than 0 (a row-wise layer's bias is added once)
        self.splits: dict[tuple[nn.Module, str], tuple] = {}
        self.attrs: list[tuple[object, str, object]] = []  # (object, attribute, original)
        self.hooks: list = []
        self.modules: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, leaf, module)
        self.moved: list[tuple[nn.Module, str, torch.Tensor]] = []  # (module, attribute, original)

    def split(self, module: nn.Module, attr: str, dim: int | None, parts: int, index_of) -> None:
        original = getattr(module, attr)
        if original is None:
            return
        self.splits[(module, attr)] = (original, dim, parts, index_of)
        set_tensor(module, attr, self.shard_of(module, attr, self.rank))

    def keep_module(self, parent: nn.Module, leaf: str, module: nn.Module) -> None:
        """Put `module` back under `parent` on restore (fused projections replace it meanwhile,
        and unfusing builds new layers of the split shapes)."""
        self.modules.append((parent, leaf, module))

    def set_attr(self, obj: object, attr: str, value) -> None:
        self.attrs.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    def shard_of(self, module: nn.Module, attr: str, rank: int) -> torch.Tensor:
        """Rank `rank`'s part of a split tensor (the tensor itself where it is not split)."""
        entry = self.splits.get((module, attr))
        if entry is None:
            return getattr(module, attr)
        original, dim, parts, index_of = entry
        if dim is None:
            return original if rank == 0 else torch.zeros_like(original)
        return original.chunk(parts, dim)[index_of(rank)]

    def tensors(self) -> list[tuple[nn.Module, str, str]]:
        """(module, attribute, qualified name) of every parameter and buffer, in a fixed order
        that a skeleton of the same class sharded the same way lists identically."""
        out = []
        for mod_name, module in self.model.named_modules():
            for attr in [*module._parameters, *module._buffers]:
                if getattr(module, attr) is not None:
                    out.append((module, attr, f"{mod_name}.{attr}" if mod_name else attr))
        return out

    def place(self, device: torch.device) -> None:
        """Move this rank's tensors to its device (the originals kept for restore; a split
        tensor's original stays where it was)."""
        for module, attr, _ in self.tensors():
            t = getattr(module, attr)
            if t.device != device:
                if (module, attr) not in self.splits:
                    self.moved.append((module, attr, t))
                set_tensor(module, attr, t.to(device))

    def restore(self) -> None:
        for handle in self.hooks:
            handle.remove()
        for module, attr, original in reversed(self.moved):
            set_tensor(module, attr, original)
        for (module, attr), (original, *_) in self.splits.items():
            set_tensor(module, attr, original)
        for obj, attr, original in reversed(self.attrs):
            setattr(obj, attr, original)
        for parent, leaf, module in self.modules:
            setattr(parent, leaf, module)
        self.hooks, self.splits, self.attrs, self.moved, self.modules = [], {}, [], [], []


def set_tensor(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    if attr in module._parameters:
        if not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        module._parameters[attr] = value
    else:
        module._buffers[attr] = value


def shard_model(model: nn.Module, rank: int, world: int) -> ShardedModel:
    """Split the model in place for `rank` of `world` (check_shardable first); collective hooks
    installed (all-reduce after row-wise layers, gather after a split lm_head)."""
    chosen = check_shardable(model, world)
    heads, kv_heads, _ = _head_counts(model)
    kv_parts = min(kv_heads, world)  # fewer KV heads than ranks: each one replicated
    sharded = ShardedModel(model, rank, world)
    modules = dict(model.named_modules())
    attention = set()
    for name, style in chosen.items():
        module = modules[name]
        leaf = name.rsplit(".", 1)[-1]
        if style == GATHER:
            if module.out_features % world:  # an uneven vocabulary: lm_head stays whole
                continue
            parts, index_of, dim = world, _identity, 0
            sharded.hooks.append(module.register_forward_hook(collectives.gather_hook))
        elif style == COLWISE:
            dim = 0
            if leaf in KV_PROJ:
                parts, index_of = kv_parts, _kv_index(world, kv_parts)
            else:
                parts, index_of = world, _identity
        else:
            parts, index_of, dim = world, _identity, 1
            sharded.hooks.append(module.register_forward_hook(collectives.all_reduce_hook))
        parent, _, _ = name.rpartition(".")
        sharded.keep_module(modules[parent], leaf, module)
        sharded.split(module, "weight", dim, parts, index_of)
        if dim == 0:
            sharded.split(module, "bias", 0, parts, index_of)
            sharded.set_attr(module, "out_features", module.out_features // parts)
        else:
            sharded.split(module, "bias", None, parts, index_of)
            sharded.set_attr(module, "in_features", module.in_features // parts)
        if leaf in ("q_proj", "o_proj"):
            attention.add(name.rsplit(".", 1)[0])
    local_heads, local_kv = heads // world, kv_heads // kv_parts
    for name in sorted(attention):
        module = modules[name]
        for attr in HEAD_ATTRS:
            if isinstance(getattr(module, attr, None), int):
                sharded.set_attr(module, attr, local_heads)
        for attr in KV_HEAD_ATTRS:
            if isinstance(getattr(module, attr, None), int):
                sharded.set_attr(module, attr, local_kv)
        if isinstance(getattr(module, "num_key_value_groups", None), int):
            sharded.set_attr(module, "num_key_value_groups", local_heads // local_kv)
    return sharded


def _identity(rank: int) -> int:
    return rank


def _kv_index(world: int, kv_parts: int):
    """The KV part a rank holds: its own, or (replicated) the one its query heads read."""
    per_part = world // kv_parts

    def index_of(rank: int) -> int:
        return rank // per_part

    return index_of
