"""Positional embeddings that take the engine step's positions.

Some decoders build their position ids inside the model from the input's length (Bart's
decoder and its kin: mBART, Marian, Pegasus, Blenderbot-small, MVP, TrOCR; `arange(seq_len) +
cache_length`) and take no `position_ids` argument. The engine runs a step's sequences as one flat
row, so those positions would run on across sequences. Their positional-embedding modules do
accept `position_ids`: inside an engine step the forward here passes them the step's positions
(ForwardContext.positions, each token's index in its own sequence); outside a step they run as
transformers wrote them.
"""

from __future__ import annotations

import inspect
import types

import torch

from hf_paged.worker.forward_context import get_forward_context, in_engine_step

_ORIGINAL = "_hf_paged_original_forward"
_RANK = "_hf_paged_position_ids_rank"


def _takes_position_ids(module: torch.nn.Module) -> bool:
    if "PositionalEmbedding" not in type(module).__name__:
        return False
    try:
        return "position_ids" in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def _position_ids_rank(module: torch.nn.Module) -> int | None:
    """The rank of position_ids the module takes for one row: [T] (Bart's and TrOCR's add the
    batch dimension themselves) or [1, T] (XGLM's); read from what it returns for 2 positions
    (other arguments are not read when position_ids are given). None: neither works."""
    signature = inspect.signature(module.forward)
    others = {
        name: None
        for name, p in signature.parameters.items()
        if name != "position_ids" and p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }  # fmt: skip
    device = next(iter(module.parameters()), torch.empty(0)).device
    for rank in (1, 2):
        ids = torch.arange(2, device=device).reshape((2,) if rank == 1 else (1, 2))
        try:
            with torch.no_grad():
                out = module.forward(**others, position_ids=ids)
        except Exception:
            continue
        if out.dim() <= 3 and out.shape[-2] == 2:
            return rank
    return None


def _step_forward(self, *args, **kwargs):
    original = self.__dict__[_ORIGINAL]
    ctx = get_forward_context()
    if not in_engine_step() or ctx is None or ctx.positions is None:
        return original(*args, **kwargs)
    # bound by name: some pass position_ids positionally (XGLM), some by keyword, some not at all
    bound = inspect.signature(original).bind_partial(*args, **kwargs)
    positions = ctx.positions
    bound.arguments["position_ids"] = positions if self.__dict__[_RANK] == 1 else positions[None]
    return original(*bound.args, **bound.kwargs)


def install_step_positions(model: torch.nn.Module) -> int:
    """Route the model's positional embeddings to the step's positions; how many were."""
    count = 0
    for module in model.modules():
        if _ORIGINAL in module.__dict__ or not _takes_position_ids(module):
            continue
        rank = _position_ids_rank(module)
        if rank is None:
            continue
        module.__dict__[_RANK] = rank
        module.__dict__[_ORIGINAL] = module.forward
        module.forward = types.MethodType(_step_forward, module)
        count += 1
    return count


def remove_step_positions(model: torch.nn.Module) -> None:
    for module in model.modules():
        original = module.__dict__.pop(_ORIGINAL, None)
        module.__dict__.pop(_RANK, None)
        if original is not None:
            module.__dict__.pop("forward", None)  # the class's forward again
