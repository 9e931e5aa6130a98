"""bitsandbytes models as transformers loaded them (BitsAndBytesConfig 4-bit nf4/fp4, double
quant, 8-bit LLM.int8): the engine runs their layers as they are. What it needs to know:

- which layers are bitsandbytes', found by class and module name so that nothing here imports
  bitsandbytes (a model without it never needs the package);
- LLM.int8 layers (Linear8bitLt) cannot be captured in a CUDA graph nor traced by
  torch.compile: with the default outlier threshold their matmul picks the outlier columns of
  each input on the host (a device-to-host sync that fails graph capture on the H200 with
  "operation failed due to a previous error during capture"). They run eagerly and turn graphs
  off, named (hf_paged/worker/graph_blockers.py). 4-bit layers (Linear4bit) dequantise on the
  device and are captured.
- fused projections skip them (integrations/fused_projections.py fuses plain nn.Linear only).
"""

from __future__ import annotations

from torch import nn


def _is_bnb(module: nn.Module, name: str) -> bool:
    cls = type(module)
    return cls.__name__ == name and cls.__module__.startswith("bitsandbytes")


def int8_linears(model: nn.Module) -> list[nn.Module]:
    """The model's bitsandbytes LLM.int8 layers."""
    return [m for m in model.modules() if _is_bnb(m, "Linear8bitLt")]


def four_bit_linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _is_bnb(m, "Linear4bit")]


def int8_reason(layers: list[nn.Module]) -> str:
    return (
        f"{len(layers)} bitsandbytes Linear8bitLt layers (load_in_8bit): LLM.int8's matmul "
        "selects outlier columns on the host, which a CUDA graph cannot capture; they run "
        "eagerly, outside torch.compile"
    )
