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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

A, B, SCALE = "hf_paged_lora_a", "hf_paged_lora_b", "hf_paged_lora_scale"


class LoraSlots:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers: dict[str, torch.nn.Module] = {}
        # adapter name -> slot, least recently used first
        self.slot_of: dict[str, int] = {}
        # adapter name -> (a layer holding it, its lora_A module there) when it was copied: a
        # different module there means peft replaced the adapter
        self._probe: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def add_layers(self, layers: dict[str, torch.nn.Module]) -> None:
        """Give these LoRA layers their (zero) buffers, filled for the adapters already in
        slots."""
        for name, layer in layers.items():
            if name in self.layers:
                continue
            weight = layer.get_base_layer().weight
            dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
            s, r = self.max_loras, self.max_rank
            kw = dict(dtype=dtype, device=weight.device)
            layer.register_buffer(A, torch.zeros(s, r, layer.in_features, **kw), persistent=False)
            layer.register_buffer(B, torch.zeros(s, layer.out_features, r, **kw), persistent=False)
            layer.register_buffer(
                SCALE, torch.zeros(s, dtype=torch.float32, device=weight.device), persistent=False
            )
            self.layers[name] = layer
            for adapter, slot in self.slot_of.items():
                self._copy(layer, adapter, slot)

    def remove_layers(self) -> None:
        for layer in self.layers.values():
            for key in (A, B, SCALE):
                layer._buffers.pop(key, None)
        self.layers = {}
        self.slot_of = {}
        self._probe = {}

    def resolve(
        self, names: set[str], running: set[str], live: Callable[[], set[str]]
    ) -> dict[str, int]:
        """The slot of each adapter in `names` (one step's), copying those not in a slot (or
        replaced by peft since) into free or reusable slots. running: the adapters of every
        running request; live(): those of every request not ended (waiting ones too), asked
        only when peft has removed an adapter that holds a slot."""
        present = set(getattr(self.model, "peft_config", {}) or {})
        gone = [n for n in self.slot_of if n not in present]
        if gone:  # removed from peft: the slot is free once no request will run it again
            keep = running | live()
            for name in gone:
                if name not in keep:
                    del self.slot_of[name]
                    self._probe.pop(name, None)
        out = {}
        for name in names:
            slot = self.slot_of.pop(name, None)
            if slot is None or (name in present and self._replaced(name)):
                slot = self._load(name, slot, names | running, present)
            self.slot_of[name] = slot  # most recently used last
            out[name] = slot
        return out

    def _replaced(self, name: str) -> bool:
        probe = self._probe.get(name)
        if probe is None:
            return False  # it targets no layer: nothing to compare (its slot is all zeros)
        layer, module = probe
        return layer.lora_A[name] is not module if name in layer.lora_A else True

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
