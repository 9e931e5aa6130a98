"""Packaging: kernels/ and integrations/ live under hf_paged, never as top-level packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_pypi_kernels_name_not_shadowed():
    # transformers probes `import kernels` (the hub-kernels PyPI package); ours must not answer.
    spec = importlib.util.find_spec("kernels")
    if spec is not None:
        origin = Path(spec.origin or next(iter(spec.submodule_search_locations))).resolve()
        assert REPO not in origin.parents, f"top-level `kernels` resolves into the repo: {origin}"


def test_subpackages_installed_under_hf_paged():
    import hf_paged.integrations
    import hf_paged.kernels

    assert Path(hf_paged.kernels.__file__).resolve().parent == REPO / "kernels"
    assert Path(hf_paged.integrations.__file__).resolve().parent == REPO / "integrations"


def test_no_conftest_at_repo_root():
    # a root conftest.py would put the repo root on sys.path and expose kernels/ as `kernels`
    assert not (REPO / "conftest.py").exists()
