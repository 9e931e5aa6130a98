"""Throughput harness smoke test: every backend generates exactly max_new_tokens per request and
the CLI prints the side-by-side table, JSON and plots (tiny workloads: CPU CI)."""

from __future__ import annotations

import importlib
import json

import pytest

from hf_paged.testing import load_evals

run = load_evals()

pytestmark = pytest.mark.slow


def test_throughput_all_backends_side_by_side(tmp_path, capsys):
    workloads = importlib.import_module("hf_paged_evals.workloads")
    # Short prompts through a workload file (the route the GPU machine uses for ShareGPT).
    wl = workloads.Workload(
        "tiny", [workloads.WorkloadRequest(list(range(100, 100 + n)), 4) for n in (12, 30)]
    )
    wl.save(tmp_path / "tiny.json")
    rc = run.main(
        [
            "throughput",
            "--model",
            "smollm2",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--backend",
            "paged,hf,hf-cb",
            "--dataset",
            str(tmp_path / "tiny.json"),
            "--max-new-tokens",
            "4",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    for row in ("| paged |", "| hf |", "| hf-cb |", "ratio paged", "roofline bound: n/a"):
        assert row in out
    [path] = tmp_path.glob("throughput-*.json")
    [result] = json.loads(path.read_text())["results"]
    assert [r["metrics"]["backend"] for r in result["runs"]] == ["paged", "hf", "hf-cb"]
    engine = result["runs"][0]["metrics"]["extra"]["engine"]  # the cache's capacity, reported
    assert engine["kv_cache_dtype"] == "float32" and engine["kv_tokens"] > 0
    assert f"KV cache {engine['kv_tokens']:,} tokens (float32)" in out
    for r in result["runs"]:
        assert [t["output_len"] for t in r["timings"]] == [4, 4]
        assert all(0 <= t["first_token"] <= t["finish"] for t in r["timings"])
    assert len(list(tmp_path.glob("*.png"))) == 2


def test_shared_prefix_hits_prefix_cache():
    backends = importlib.import_module("hf_paged_evals.backends")
    models = importlib.import_module("hf_paged_evals.models")
    workloads = importlib.import_module("hf_paged_evals.workloads")
    loaded = models.load_model("smollm2", "float32", "cpu")
    # A 64-token shared prefix (4 full blocks) instead of 1024 keeps CPU CI fast; one request
    # at a time, so the 2nd and 3rd find the 1st's blocks cached.
    wl = workloads.shared_prefix(
        loaded.model.config.vocab_size,
        num_requests=3,
        prefix_len=64,
        min_question=4,
        max_question=8,
        output_len=2,
    )
    wl.max_concurrency = 1
    names = list(loaded.model.state_dict())
    run_ = backends.run_paged(
        loaded.model, wl, concurrency=1, engine_options={"fuse_projections": True}, progress=False
    )
    assert [t.output_len for t in run_.timings] == [2, 2, 2]
    assert run_.extra["prefix_cache_hit_rate"] > 0.5
    assert run_.extra["engine"]["fuse_projections"]
    assert run_.extra["engine"]["mixed_step_graphs"] == 0  # CPU: no graphs
    # CPU: the torch attention backend, so transformers' forward at every batch size, and why
    assert run_.extra["engine"]["small_batch_forward"].startswith("off (attention backend")
    # the baselines that follow in the same invocation get the model as loaded
    assert list(loaded.model.state_dict()) == names


def test_report_says_which_steps_replay_graphs():
    throughput = importlib.import_module("hf_paged_evals.throughput")
    text = throughput._graphs_text
    assert text({"cuda_graphs": False, "mixed_step_graphs": 0}) == "off"
    assert text({"cuda_graphs": True, "mixed_step_graphs": 0}) == "on (decode only)"
    assert "18 mixed-step" in text({"cuda_graphs": True, "mixed_step_graphs": 18})
    assert text({"cuda_graphs": True}) == "on"  # results saved before mixed-step graphs
