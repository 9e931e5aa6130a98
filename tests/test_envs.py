"""hf_paged/envs.py is the one place the library, its kernels and its evals read the environment."""

from __future__ import annotations

import re
from pathlib import Path

from hf_paged import envs

ROOT = Path(__file__).resolve().parents[1]
_READ = re.compile(r"os\.environ\s*(\.get|\[|\.setdefault|\.pop)|os\.getenv|getenv\(")


def test_no_module_but_the_registry_reads_the_environment():
    readers = []
    for folder in ("hf_paged", "kernels", "integrations", "evals"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "hf_paged" / "envs.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _READ.search(line):
                    readers.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not readers, readers
    assert (ROOT / "hf_paged" / "envs.py").read_text().count("os.environ.get(") == len(
        envs.environment_variables
    )


def test_variables_are_read_when_asked_not_at_import(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path))
    assert envs.HF_PAGED_CACHE == tmp_path
    monkeypatch.delenv("HF_PAGED_CACHE")
    assert envs.HF_PAGED_CACHE == Path.home() / ".cache" / "hf_paged"
    monkeypatch.setenv("PIP_INDEX_URL", "http://index.example/simple")
    assert envs.PIP_INDEX_URL == "http://index.example/simple"
    assert sorted(dir(envs)) == sorted(envs.environment_variables)
