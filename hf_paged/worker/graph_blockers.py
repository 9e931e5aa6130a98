"""The parts of a model that a CUDA graph cannot capture nor torch.compile trace, in one place.

Each kind of part (transformers' grouped_mm MoE experts on non-bfloat16 weights, bitsandbytes
LLM.int8 layers, ...) contributes its modules and a reason. The compiled forward runs those
modules eagerly (hf_paged/worker/compilation.py), and the model runner captures no graphs for
the model, warning with every reason (hf_paged/worker/startup.py): slower, never a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_paged.quantization.bitsandbytes import int8_linears, int8_reason
from hf_paged.worker.moe_experts import graph_blocker as experts_reason
from hf_paged.worker.moe_experts import uncapturable_experts


@dataclass(frozen=True, slots=True)
class Uncapturable:
    modules: list[torch.nn.Module]
    reason: str


def uncapturable_parts(model: torch.nn.Module) -> list[Uncapturable]:
    parts = []
    experts = uncapturable_experts(model)
    if experts:
        parts.append(Uncapturable(experts, experts_reason(model)))
    int8 = int8_linears(model)
    if int8:
        parts.append(Uncapturable(int8, int8_reason(int8)))
    return parts


def graph_blocker(model: torch.nn.Module) -> str | None:
    """Why the model's forward cannot be captured in a CUDA graph (every reason), or None."""
    reasons = [part.reason for part in uncapturable_parts(model)]
    return "; ".join(reasons) if reasons else None


def eager_inside_compile(model: torch.nn.Module) -> Callable[[], None]:
    """Run every uncapturable module eagerly inside a compiled model; returns the undo."""
    eager = [m for part in uncapturable_parts(model) for m in part.modules]
    for module in eager:
        module.forward = torch.compiler.disable(module.forward)

    def undo() -> None:
        for module in eager:
            del module.forward  # the instance attribute: the class's forward again

    return undo
