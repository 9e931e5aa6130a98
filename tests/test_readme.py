"""README.md is user documentation within 15 KB whose every named file and script exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# docs/x.md, evals/RESULTS.md, evals/profiling/engine_bench.py, hf_paged/envs.py, tests/conftest.py
_PATH = re.compile(r"\b((?:docs|evals|hf_paged|tests|kernels|integrations)/[\w/.-]*\w\.(?:md|py))")


def test_readme_stays_within_15_kb():
    assert len(README.encode()) <= 15_000


def test_every_file_the_readme_names_exists():
    named = set(_PATH.findall(README))
    assert len(named) >= 10  # the pattern still finds the references
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
