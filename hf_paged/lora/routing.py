"""A PeftModel's LoRA adapters while an engine holds the model: which adapters a request may
name, how many may be live at once, and which slot each one's tokens use in a step.

- check(name), when a request is added: the adapter exists (peft's load_adapter / add_adapter
  after start-up count), fits max_lora_rank, and its layers are routed (an adapter loaded later
  may target modules no adapter targeted before: peft wraps them, and they are routed here before
  the request is admitted, so no step runs its tokens through an unrouted layer).
- room(name, running), from the scheduler (core/adapter_seats.py): whether a waiting request of
  that adapter may start, at most max_loras distinct adapters running at once (vLLM's max_loras
  per step), so every step finds a slot for each adapter it runs; the others wait.
- admitting(requests, ...), around queueing requests: tracks the live requests' adapters. With
  more than one Engine on the model (their schedulers do not see each other's waiting
  requests), more than max_loras distinct adapters among live requests (running, waiting or
  queued) are refused with a ValueError naming max_loras instead.
- slots_for(names), once per step from the runner's side: LoraSlots.resolve.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Container, Iterator

import torch

from hf_paged.lora.layers import (
    adapter_names,
    check_supported,
    install,
    lora_layers,
    uninstall,
)
from hf_paged.lora.slots import LoraSlots


def max_rank(layers: dict[str, torch.nn.Module]) -> int:
    return max((r for layer in layers.values() for r in layer.r.values()), default=1)


class LoraRouting:
    def __init__(
        self,
        model: torch.nn.Module,
        layers: dict[str, torch.nn.Module],
        max_loras: int,
        rank: int,
        graphs: bool = False,
    ) -> None:
        self.model = model
        # CUDA graphs captured the forward: a LoRA layer peft adds later is not in them
        self.graphs = graphs
        self.layers = dict(layers)
        self.max_loras = max_loras
        self.max_rank = rank
        self.slots = LoraSlots(model, max_loras, rank)
        self._seen = adapter_names(model)
        self._checked: set[str] = set()
        # adapters loaded after start-up on modules no adapter targeted before, with graphs on
        self._unroutable: set[str] = set()
        # (inbox, request id) -> (adapter, the scheduler's requests) of every request admitted
        # with an adapter, by the Engine owning that inbox (Engines on one model share slots)
        self._live: dict[tuple[object, str], tuple[str, Container]] = {}
        self._count: Counter[str] = Counter()  # adapter -> its entries in _live
        self._prune_at = 1024
        self._lock = threading.Lock()
        self._batches = weakref.WeakSet()  # the InputBatches of the Engines on the model
        install(self.layers)
        self.slots.add_layers(self.layers)

    def adapters(self) -> set[str]:
        """The adapters the model has now; layers of adapters added since are routed."""
        names = adapter_names(self.model)
        if names - self._seen:
            found = lora_layers(self.model)
            new = {k: v for k, v in found.items() if k not in self.layers}
            check_supported(self.model, found)
            if new and self.graphs:  # refused by check(); other adapters run as before
                self._unroutable |= {
                    n
                    for n in names - self._seen
                    if any(n in layer.lora_A for layer in new.values())
                }
            install(new)
            self.slots.add_layers(new)
            self.layers.update(new)
            self._seen = names
            self._checked &= names
        return names

    def check(self, name: str) -> None:
        """A request names this adapter: refuse it (ValueError naming the field) unless it can
        run."""
        known = self.adapters()
        if name not in known:
            raise ValueError(f"adapter: unknown adapter {name!r}; the model has {sorted(known)}")
        if name in self._unroutable:
            raise ValueError(
                f"adapter: {name!r} targets modules no adapter targeted when the engine started; "
                "its CUDA graphs do not run through them: load it before the engine starts, or "
                "pass cuda_graphs=False"
            )
        if name in self._checked:
            return
        for layer_name, layer in self.layers.items():
            rank = layer.r.get(name, 0) if name in layer.lora_A else 0
            if rank > self.max_rank:
                raise ValueError(
                    f"adapter: {name!r} has rank {rank} on {layer_name}, more than max_lora_rank "
                    f"({self.max_rank}); start the engine with max_lora_rank={rank} or more"
                )
        self._checked.add(name)

    @contextlib.contextmanager
    def admitting(self, requests, inbox, scheduled: Container) -> Iterator[None]:
        """Around queueing these requests in an Engine's inbox: refuse them if their adapters and
        those of the live requests would be more than max_loras; forget them again if the
        queueing fails. A request is live while inbox.knows it (queued, or in `scheduled`, the
        scheduler's requests: running or waiting)."""
        wanted = {r.request_id: r.sampling_params.adapter for r in requests}
        wanted = {rid: name for rid, name in wanted.items() if name is not None}
        if not wanted:
            yield
            return
        with self._lock:
            if len(self._live) > self._prune_at:  # amortised: ended requests do not pile up
                self._prune()
            if len(set(self._count) | set(wanted.values())) > self.max_loras:
                self._prune()  # (only ever fewer)
            live = set(self._count)
            names = live | set(wanted.values())
            if len(names) > self.max_loras and len(self._batches) > 1:
                raise ValueError(
                    f"adapter: {len(names)} distinct LoRA adapters would be live at once "
                    f"({sorted(names)}; running or waiting: {sorted(live)}), more than max_loras "
                    f"({self.max_loras}); start the engine with a larger max_loras, or add these "
                    "requests once others have finished"
                )
            keys = [(inbox, rid) for rid in wanted]
            for key, name in zip(keys, wanted.values()):
                self._add_live(key, name, scheduled)
            try:
                yield
            except BaseException:
                for key in keys:
                    self._drop_live(key)
                raise

    def attach(self, input_batch) -> None:
        """An Engine's runner rows: its steps resolve slots here, and its running requests'
        adapters keep their slots."""
        self._batches.add(input_batch)
        input_batch.lora = self

    def detach(self, input_batch) -> None:
        """An Engine on the model shut down: its rows no longer hold slots."""
        self._batches.discard(input_batch)

    def room(self, name: str, running: set[str]) -> bool:
        """Whether a request of adapter `name` may start beside the adapters running: the
        calling Engine's (`running`, with those its step starts), every Engine's rows on the
        model, and removed adapters whose slots are kept for their waiting requests."""
        busy = (set(running) | self._running_adapters()) - {None}
        kept = self.slots.kept_for_removed()
        if kept:  # (a removed adapter no request needs any more frees its slot at the next step)
            busy |= kept & self._live_adapters()
        return name in busy or len(busy) < self.max_loras

    def slots_for(self, names: set[str]) -> dict[str, int]:
        return self.slots.resolve(names, self._running_adapters, self._live_adapters)

    def _running_adapters(self) -> set[str]:
        """The adapters of every Engine's running rows on the model."""
        running = set()
        for ib in list(self._batches):
            running.update(ib.adapter[row] for row in ib.req_to_row.values())
        running.discard(None)
        return running

    def _live_adapters(self) -> set[str]:
        """The adapters of every request admitted and not ended (running, waiting, queued)."""
        with self._lock:
            self._prune()
            return set(self._count)

    def _add_live(self, key, name: str, scheduled: Container) -> None:
        if key in self._live:  # a request id used again after its request ended
            self._drop_live(key)
        self._live[key] = (name, scheduled)
        self._count[name] += 1

    def _drop_live(self, key) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._count[entry[0]] -= 1
            if not self._count[entry[0]]:
                del self._count[entry[0]]

    def _prune(self) -> None:
        """Forget the requests that have ended."""
        for key in [k for k, (_, live) in self._live.items() if not k[0].knows(k[1], live)]:
            self._drop_live(key)
        self._prune_at = max(1024, 2 * len(self._live))

    def close(self) -> None:
        uninstall(self.layers)
        self.slots.remove_layers()


def admitting(routing: LoraRouting | None, requests, inbox, scheduled: Container):
    """LoraRouting.admitting for an Engine (its inbox and its scheduler's requests tell which
    requests have not ended), or nothing to check for a model without LoRA."""
    if routing is None:
        return contextlib.nullcontext()
    return routing.admitting(requests, inbox, scheduled)


def route_adapters(model: torch.nn.Module, config, lease) -> LoraRouting | None:
    """An Engine starting on the model: if it has LoRA layers, check them, fit the options to
    the LoRA path (warning when that turns something off on a GPU) and route the layers, once
    per model (lease: the model's ModelLease; its last owner puts the layers back)."""
    layers = lora_layers(model)
    if not layers:
        return None
    check_supported(model, layers)
    rank = config.max_lora_rank
    if rank is None:
        rank = config.max_lora_rank = max_rank(layers)
    else:
        too_big = {n: r for layer in layers.values() for n, r in layer.r.items() if r > rank}
        if too_big:
            raise ValueError(f"max_lora_rank: {rank} is less than the rank of adapter(s) {too_big}")
    if lease.lora is None:
        graphs = config.cuda_graphs and next(model.parameters()).is_cuda
        lease.lora = LoraRouting(model, layers, config.max_loras, rank, graphs)
    else:  # another Engine on the model: its slots are the ones the first Engine made
        config.max_loras, config.max_lora_rank = lease.lora.max_loras, lease.lora.max_rank
        lease.lora.graphs |= config.cuda_graphs and next(model.parameters()).is_cuda
    return lease.lora
