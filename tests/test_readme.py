"""README.md is user documentation within 15 KB whose every named file and script exists; every
log under evals/h200, h100 and cpu backs a number some page names, and every named log exists."""

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


# the results page's logs: h200/x.log, cpu/y-2026-12-01.{log,json} (one name, several files)
_LOG = re.compile(r"\b((?:h200|h100|cpu)/[\w.-]*\w)(?:\.\{([\w,]+)\})?")
LOG_FOLDERS = ("h200", "h100", "cpu")


def test_every_log_backs_a_named_number_and_every_named_log_exists():
    pages = [ROOT / "evals" / "RESULTS.md", ROOT / "evals" / "README.md", ROOT / "README.md"]
    text = "".join(p.read_text() for p in pages + sorted((ROOT / "docs").glob("*.md")))
    named = set()
    for stem, extensions in _LOG.findall(text):
        named |= {f"{stem}.{e}" for e in extensions.split(",")} if extensions else {stem}
    kept = {
        f"{p.parent.name}/{p.name}" for d in LOG_FOLDERS for p in (ROOT / "evals" / d).iterdir()
    }
    assert len(kept) >= 50  # the folders are still where this test looks
    assert not sorted(kept - named), "logs no page names: delete them or name what they back"
    assert not sorted(named - kept), "pages name logs that are not there"
