"""The start-up commands on a saved tiny model: `hf-paged warmup` (builds an Engine once, fills
the compile caches, prints the breakdown) and `evals/run.py startup` (cold and warm processes)."""

from __future__ import annotations

import json

import pytest

from hf_paged import envs
from hf_paged.entrypoints.cli import main
from hf_paged.testing import load_evals, tiny_tokenizer
from hf_paged.worker.startup_times import PHASES


@pytest.fixture
def model_dir(tmp_path, tiny_model):
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def no_cache_folders(monkeypatch):
    for name in envs.COMPILE_CACHE_DIRS:  # set first: the test's end puts back what was there
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


def test_warmup_builds_an_engine_and_prints_the_breakdown(
    model_dir, tmp_path, capsys, no_cache_folders
):
    cache = tmp_path / "cc"
    argv = ["warmup", str(model_dir), "--compile-cache", str(cache)]
    assert main([*argv, "--engine-option", "num_blocks=64", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in out if line.startswith("  ") and " s" in line}
    assert set(PHASES) <= set(rows)
    total = float(out[[i for i, line in enumerate(out) if "engine start-up" in line][0]].split()[2])
    assert total == pytest.approx(sum(float(rows[p].split()[1]) for p in PHASES), abs=0.06)
    assert any(line.startswith("  first request (64-token prompt, 8 new): ") for line in out)
    assert f"  TORCHINDUCTOR_CACHE_DIR: {(cache / 'inductor').resolve()}" in out
    assert f"  TRITON_CACHE_DIR: {(cache / 'triton').resolve()}" in out


def test_warmup_refuses_bad_options_before_loading(capsys):
    assert main(["warmup", "no-such-model", "--engine-option", "num_blokcs=4"]) == 2
    assert "num_blokcs" in capsys.readouterr().err
    assert main(["serve", "no-such-model", "--engine-option", "num_blokcs=4"]) == 2  # dispatched


def test_evals_startup_runs_cold_then_warm_processes(model_dir, tmp_path, capsys):
    run = load_evals()
    cache = tmp_path / "cc"
    argv = ["startup", "--model", str(model_dir), "--device", "cpu", "--prompt-len", "16"]
    assert run.main([*argv, "--out", str(tmp_path), "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "| seconds | cold caches | warm caches |" in out
    for phase in PHASES:
        assert f"| {phase} | " in out
    assert "| **engine start-up** |" in out and "| first / warm TTFT |" in out
    assert "- goals: warm start-up <= 10 s: " in out
    saved = json.loads(next(tmp_path.glob("startup-*.json")).read_text())
    for run_name in ("cold", "warm"):
        result = saved["runs"][run_name]
        stats = result["startup"]
        assert sum(stats[f"{p}_s"] for p in PHASES) == pytest.approx(stats["total_s"], abs=1e-6)
        assert result["first_ttft_s"] > 0 and result["warm_ttft_s"] > 0
        assert set(result["cache_files"]) == {"inductor", "triton"}
    # the cold process needs an empty folder
    cache.mkdir(exist_ok=True)  # nothing compiles on the CPU: nothing made it
    (cache / "stale").write_text("x")
    assert run.main([*argv, "--out", str(tmp_path), "--cache-dir", str(cache)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_evals_startup_cprofile_prints_each_process_profile(model_dir, tmp_path, capsys):
    """--cprofile: each process's Engine(...) under cProfile, the top functions with callees,
    Engine's own __init__ among them (it holds all the rest)."""
    run = load_evals()
    argv = ["startup", "--model", str(model_dir), "--device", "cpu", "--prompt-len", "16"]
    assert run.main([*argv, "--out", str(tmp_path), "--cprofile"]) == 0
    out = capsys.readouterr().out
    for run_name in ("cold", "warm"):
        head = f"({run_name} compile caches)\n### Engine(...) profile: 1 start-up, "
        assert head in out, out[-2000:]
        table = out[out.index(head) :].split("\n\n(")[0]
        assert "engine.py" in table and "(__init__)" in table, table
