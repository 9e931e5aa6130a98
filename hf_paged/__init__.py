"""hf_paged: paged-attention continuous batching behind transformers' model.generate.

import hf_paged
hf_paged.patch(model)            # engine options as keyword arguments
model.generate(**inputs, max_new_tokens=64)
hf_paged.unpatch(model)
"""

from hf_paged.config import EngineConfig
from hf_paged.core.request import RequestOutput
from hf_paged.engine import Engine
from hf_paged.generation.patching import get_engine, patch, unpatch
from hf_paged.generation.pipelines import pipeline
from hf_paged.integrations.pipeline import install as _install_pipeline_backend
from hf_paged.sampling_params import SamplingParams
from hf_paged.structured_output import StructuredOutputs

__all__ = [
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
    "get_engine",
    "patch",
    "pipeline",
    "unpatch",
]
_install_pipeline_backend()  # transformers.pipeline(..., backend="paged"); no backend: unchanged
__version__ = "0.1.0"
