"""Adapters in slots: each LoRA layer of a PeftModel gets stacked device buffers
A [max_loras, max_lora_rank, in], B [max_loras, out, max_lora_rank] and scale [max_loras]
(float32), and LoraSlots decides which adapter each slot holds.

An adapter is copied (peft keeps its own weights) into a free slot the first time a step runs it,
zero-padded to max_lora_rank, with peft's `scaling` (lora_alpha / r, or / sqrt(r) with rslora)
per slot; a layer the adapter does not target gets a zero slot (its tokens get the base output
there). The buffers never change shape, so loading, evicting or replacing an adapter is a copy
into existing memory: nothing that captured or compiled the forward has to notice.

A slot is reused (least recently used first) only when no running request uses its adapter; an
adapter peft no longer has (delete_adapter) keeps its slot until its running requests end, so
they finish with the weights they started with. An adapter peft replaced under the same name
(deleted and added again) is copied again at its next use.

The buffers are the layer's non-persistent buffers (not in state_dict): under torch.compile
they are graph inputs like the weights, so every decoder layer still shares one compiled graph.

Fused projections (integrations/fused_projections.py: q/k/v, gate/up): the group's buffers live
on the FusedProjection, A [max_loras, slices * max_lora_rank, in] (each slice's rows in turn),
B [max_loras, sum(out), max_lora_rank] and scale [slices, max_loras], and the LoRA layer of each
slice holds views of its part, so copying an adapter into a slot writes the group's buffers
once and one shrink / one expand (hf_paged/lora/layers.py::group_add_) covers every slice. A
slice no adapter targets keeps zeros there (its columns get the base output).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hf_paged.lora import fold

A, B, SCALE = "hf_paged_lora_a", "hf_paged_lora_b", "hf_paged_lora_scale"
# a FusedProjection's group buffers, and the routed LoRA layer of each of its slices
GROUP_A, GROUP_B = "hf_paged_lora_group_a", "hf_paged_lora_group_b"
GROUP_SCALE = "hf_paged_lora_group_scale"
WRAPPERS = "hf_paged_lora_wrappers"


def projection_slice(layer: torch.nn.Module):
    """The ProjectionSlice a LoRA layer wraps (a fused q/k/v or gate/up slice), else None."""
    from hf_paged.integrations.fused_projections import ProjectionSlice

    base = getattr(layer, "base_layer", None)
    return base if isinstance(base, ProjectionSlice) else None


class LoraSlots:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers: dict[str, torch.nn.Module] = {}
        self._groups: list[torch.nn.Module] = []  # FusedProjections holding group buffers
        # adapter name -> slot, least recently used first
        self.slot_of: dict[str, int] = {}
        # adapter name -> (a layer holding it, its lora_A module there) when it was copied: a
        # different module there means peft replaced the adapter
        self._probe: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}
        self._folded = False  # fold_shrinks ran (it runs once)

    def add_layers(self, layers: dict[str, torch.nn.Module]) -> None:
        """Give these LoRA layers their (zero) buffers, filled for the adapters already in
        slots."""
        for name, layer in layers.items():
            if name in self.layers:
                continue
            part = projection_slice(layer)
            if part is not None:
                views = self._group_views(part, layer)
            else:
                weight = layer.get_base_layer().weight
                s, r = self.max_loras, self.max_rank
                kw = dict(dtype=_dtype(weight), device=weight.device)
                views = (
                    torch.zeros(s, r, layer.in_features, **kw),
                    torch.zeros(s, layer.out_features, r, **kw),
                    torch.zeros(s, dtype=torch.float32, device=weight.device),
                )
            for key, buf in zip((A, B, SCALE), views):
                layer.register_buffer(key, buf, persistent=False)
            self.layers[name] = layer
            for adapter, slot in self.slot_of.items():
                self._copy(layer, adapter, slot)
        self.regroup()

    def regroup(self) -> None:
        """Give the layers whose projection was fused after they got their own buffers (the
        engine routes adapters before it fuses) views of their group's, contents kept: a group
        adds the deltas of every slice it knows, and its slices' layers then add none."""
        for layer in self.layers.values():
            part = projection_slice(layer)
            if part is None or (part.fused.__dict__.get(WRAPPERS) or {}).get(part.index) is layer:
                continue
            own = [layer._buffers[key] for key in (A, B, SCALE)]
            with torch.no_grad():
                for key, old, view in zip((A, B, SCALE), own, self._group_views(part, layer)):
                    view.copy_(old)
                    layer.register_buffer(key, view, persistent=False)

    def _group_views(self, part, layer: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        """This slice's views of its FusedProjection's group buffers (made on first use)."""
        fused = part.fused
        if GROUP_A not in fused._buffers:
            s, r, n = self.max_loras, self.max_rank, len(fused.sizes)
            kw = dict(dtype=_dtype(fused.weight), device=fused.weight.device)
            fused.register_buffer(
                GROUP_A, torch.zeros(s, n * r, fused.weight.shape[1], **kw), persistent=False
            )
            fused.register_buffer(
                GROUP_B, torch.zeros(s, sum(fused.sizes), r, **kw), persistent=False
            )
            fused.register_buffer(
                GROUP_SCALE,
                torch.zeros(n, s, dtype=torch.float32, device=fused.weight.device),
                persistent=False,
            )
            fused.__dict__[WRAPPERS] = {}  # slice -> its LoRA layer (not submodules: peft's)
            from hf_paged.lora.layers import group_product  # (layers imports this module)

            fused.product_hook = group_product
            self._groups.append(fused)
        i, r = part.index, self.max_rank
        fused.__dict__[WRAPPERS][i] = layer
        return (
            fused._buffers[GROUP_A][:, i * r : (i + 1) * r],
            fused._buffers[GROUP_B][:, fused.rows(i)],
            fused._buffers[GROUP_SCALE][i],
        )

    def after_fusing(self) -> None:
        """An Engine fused the model's projections (start-up, before compile and graphs)."""
        self.regroup()
        self.fold_shrinks()

    def fold_shrinks(self) -> None:
        """Append the slots' A rows to the base weights where that pays (hf_paged/lora/fold.py),
        once, at the first Engine's start-up, after fusing and before anything compiles or
        captures the forward: a weight moved later would leave a captured graph reading freed
        memory. Layers routed later keep their own A and a separate shrink."""
        if self._folded:
            return
        self._folded = True
        r = self.max_rank
        for fused in self._groups:
            a = fused._buffers[GROUP_A]
            if not fold.foldable(fused.weight, a.shape[0] * a.shape[1]):  # (FP8: by its dtype)
                continue
            a = fold.extend(fused, a)
            fused.register_buffer(GROUP_A, a, persistent=False)
            for i, layer in fused.__dict__[WRAPPERS].items():
                layer.register_buffer(A, a[:, i * r : (i + 1) * r], persistent=False)
        for layer in self.layers.values():
            base = layer.base_layer
            a = layer._buffers[A]
            if type(base) is nn.Linear and fold.foldable(base.weight, a.shape[0] * a.shape[1]):
                layer.register_buffer(A, fold.extend(base, a), persistent=False)

    def remove_layers(self) -> None:
        for layer in self.layers.values():
            for key in (A, B, SCALE):
                layer._buffers.pop(key, None)
            fold.restore(layer.base_layer)
        for fused in self._groups:
            fold.restore(fused)
            for key in (GROUP_A, GROUP_B, GROUP_SCALE):
                fused._buffers.pop(key, None)
            fused.__dict__.pop(WRAPPERS, None)
            fused.__dict__.pop("product_hook", None)
        self._groups = []
        self.layers = {}
        self.slot_of = {}
        self._probe = {}

    def resolve(
        self,
        names: set[str],
        running: Callable[[], set[str]],
        live: Callable[[], set[str]],
    ) -> dict[str, int]:
        """The slot of each adapter in `names` (one step's), copying those not in a slot (or
        replaced by peft since) into free or reusable slots. running(): the adapters of every
        running request; live(): those of every request not ended (waiting ones too). Both are
        asked only when a slot may change hands (a step's usual call needs neither: a loop over
        every running row each step cost ~14 us of ~76 for 256 rows on a 2-core CPU)."""
        present = set(getattr(self.model, "peft_config", {}) or {})
        gone = [n for n in self.slot_of if n not in present]
        if gone:  # removed from peft: the slot is free once no request will run it again
            keep = running() | live()
            for name in gone:
                if name not in keep:
                    del self.slot_of[name]
                    self._probe.pop(name, None)
        out = {}
        for name in names:
            slot = self.slot_of.pop(name, None)
            if slot is None or (name in present and self._replaced(name)):
                slot = self._load(name, slot, names | running(), present)
            self.slot_of[name] = slot  # most recently used last
            out[name] = slot
        return out

    def kept_for_removed(self) -> set[str]:
        """Adapters peft has removed that still hold a slot (kept while requests of theirs may
        run: peft cannot give the weights again)."""
        present = set(getattr(self.model, "peft_config", {}) or {})
        return {n for n in self.slot_of if n not in present}

    def _replaced(self, name: str) -> bool:
        probe = self._probe.get(name)
        if probe is None:
            return False  # it targets no layer: nothing to compare (its slot is all zeros)
        layer, module = probe
        # the ModuleDict's own dict: its __contains__ / __getitem__ cost ~1 us each, every
        # adapter of every step
        return layer.lora_A._modules.get(name) is not module

    def _load(self, name: str, slot: int | None, keep: set[str], present: set[str]) -> int:
        if slot is None:
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                # never a removed adapter's slot: its waiting requests could not copy it again
                victim = next((n for n in self.slot_of if n not in keep and n in present), None)
                if victim is None:  # admission (LoraRouting.admitting) keeps this from happening
                    raise RuntimeError(
                        f"max_loras: every one of the {self.max_loras} LoRA slots holds an "
                        f"adapter of a running request; no slot for {name!r}"
                    )
                slot = self.slot_of.pop(victim)
                self._probe.pop(victim, None)
        self._probe.pop(name, None)
        for layer in self.layers.values():
            self._copy(layer, name, slot)
            if name in layer.lora_A and name not in self._probe:
                self._probe[name] = (layer, layer.lora_A[name])
        return slot

    @torch.no_grad()
    def _copy(self, layer: torch.nn.Module, name: str, slot: int) -> None:
        a, b, scale = getattr(layer, A), getattr(layer, B), getattr(layer, SCALE)
        a[slot].zero_()
        b[slot].zero_()
        scale[slot] = 0.0
        if name not in layer.lora_A:  # this adapter does not target this layer
            return
        weight_a, weight_b = layer.lora_A[name].weight, layer.lora_B[name].weight
        rank = weight_a.shape[0]
        if rank > self.max_rank:  # LoraRouting.check refuses the request before this
            raise ValueError(f"max_lora_rank: adapter {name!r} has rank {rank} > {self.max_rank}")
        a[slot, :rank].copy_(weight_a)
        b[slot, :, :rank].copy_(weight_b)
        scale[slot] = float(layer.scaling[name])


def _dtype(weight: torch.Tensor) -> torch.dtype:
    return weight.dtype if weight.dtype.is_floating_point else torch.float32
