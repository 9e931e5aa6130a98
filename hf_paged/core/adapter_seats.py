"""Which waiting requests may start this step as far as LoRA is concerned: vLLM's max_loras per
step. A LoRA slot holds one adapter's weights; every adapter a step runs needs one, so the
requests running at once may name at most max_loras distinct adapters. A waiting request whose
adapter would be one too many stays waiting (those behind it may start: another adapter, or the
base model) until a running adapter's requests have ended.

The scheduler asks `room(name, running)` of the model's hf_paged.lora.routing.LoraRouting (it
also counts the adapters of other Engines on the same model), once per adapter a step.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_paged.core.request import Request


class AdapterSeats:
    def __init__(self, room: Callable[[str, set[str]], bool], running: list[Request]) -> None:
        self.room, self.running = room, running
        self.names: set[str] | None = None  # the running adapters, read at the first adapter
        self.refused: set[str] = set()  # asked this step: no seat (no second ask)

    def admit(self, request: Request) -> bool:
        """True when the request may start (its adapter runs already, or there is room for it);
        its adapter then counts as running for the rest of this step."""
        name = request.sampling_params.adapter
        if name is None:
            return True
        if self.names is None:
            self.names = {r.sampling_params.adapter for r in self.running} - {None}
        if name in self.names:
            return True
        if name in self.refused or not self.room(name, self.names):
            self.refused.add(name)
            return False
        self.names.add(name)
        return True


def held_back(request: Request, seats: AdapterSeats | None) -> bool:
    """A waiting request that cannot start this step whatever the budget: its grammar is still
    compiling (structured output), or its LoRA adapter has no seat."""
    if request.grammar is not None and not request.grammar.ready:
        return True
    return seats is not None and not seats.admit(request)
