"""transformers' MoE experts (`@use_experts_implementation`) as the engine's compile and CUDA
graphs meet them.

With `experts_implementation="grouped_mm"` (transformers' default), weights that are not bfloat16
go two ways, neither of which a CUDA graph can capture: under dynamo, a fallback that loops over
`offs.tolist()` (a host sync; its compiled form also peaked at ~120 GiB in the start-up profile
of a 2-layer DeepSeek-V3 shape at 8192 tokens), and eagerly, `torch._grouped_mm`, whose
non-bfloat16 path copies from the host. So such experts run outside the compiled graph (the eager
kernel transformers' own generate runs, so outputs stay the same) and the engine captures no
graphs for the model, saying why."""

from __future__ import annotations

import torch


def uncapturable_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules that run grouped_mm on weights that are not bfloat16."""
    found = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if not hasattr(module, "_is_expert_parallel") or config is None:
            continue  # not a @use_experts_implementation class
        weight = next(module.parameters(recurse=False), None)
        if getattr(config, "_experts_implementation", None) != "grouped_mm" or weight is None:
            continue
        if weight.dtype != torch.bfloat16:
            found.append(module)
    return found


def graph_blocker(model: torch.nn.Module) -> str | None:
    """Why the model's experts cannot be captured in a CUDA graph, or None (collected with the
    other parts in hf_paged/worker/graph_blockers.py)."""
    experts = uncapturable_experts(model)
    if not experts:
        return None
    dtype = next(experts[0].parameters(recurse=False)).dtype
    return (
        f"{type(experts[0]).__name__} runs transformers' grouped_mm experts on {dtype} weights, "
        "whose non-bfloat16 path copies from the host inside the forward"
    )
