"""evals CLI: bad inputs end with one `error: ...` line and exit code 2; pure helpers."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged.testing import load_evals

EVALS = Path(__file__).resolve().parents[1] / "evals"

run = load_evals()
sources = importlib.import_module("hf_paged_evals.sources")
workloads = importlib.import_module("hf_paged_evals.workloads")
roofline = importlib.import_module("hf_paged_evals.roofline")
models = importlib.import_module("hf_paged_evals.models")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["accuracy", "--dataset", "nope"], "unknown dataset 'nope'"),
        (["throughput", "--dataset", "nope"], "unknown dataset 'nope'"),
        (["throughput", "--dataset", "/no/such/workload.json"], "workload file not found"),
        (["throughput", "--model", "/no/such/model"], "model path not found"),
        (["throughput", "--model", "not-a-model"], "unknown model 'not-a-model'"),
        (["throughput", "--backend", "vllm"], "unknown backend 'vllm'"),
        (["accuracy", "--dtype", "float8"], "unknown dtype 'float8'"),
        (["accuracy", "--dataset", "TMP/bad.jsonl"], "as JSON lines"),
        (["accuracy", "--dataset", "TMP/cols.jsonl"], "needs a prompt, text or input/choices"),
        (["accuracy", "--backend", "vllm"], "accuracy backend 'vllm'"),
        (["quant-accuracy", "--modes", "int4"], "unknown mode 'int4'"),
    ],
)
def test_bad_input_is_one_error_line(argv, message, capsys, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{broken\n')
    (tmp_path / "cols.jsonl").write_text('{"a": 1}\n')
    argv = [a.replace("TMP", str(tmp_path)) for a in argv]
    assert run.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_bad_dataset_files(tmp_path):
    with pytest.raises(sources.EvalError, match="dataset file not found"):
        sources.load_json_dataset(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(sources.EvalError, match="cannot read .* as JSON lines"):
        sources.load_json_dataset(str(bad))
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "ok"}\n')
    with pytest.raises(sources.EvalError, match="lacks column"):
        sources.load_json_dataset(str(good), ("prompt",))


def test_script_entry_point_error_line(tmp_path):
    # As users run it: the script's folder must not shadow anything (PyPI's `kernels` package,
    # which transformers probes), and no traceback on bad input.
    env = dict(os.environ, HF_PAGED_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, str(EVALS / "run.py"), "throughput", "--dataset", "nope"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        (
            "error: unknown dataset 'nope' for throughput: use one of synthetic, sharegpt, "
            "shared-prefix, batch1, long-decode or a workload .json file"
        )
    ]


def test_truncated_json_array_parses_whole_objects():
    text = '[\n {"a": 1},\n {"a": 2, "b": [1, 2]},\n {"a": 3, "b": "cut he'
    assert list(sources._iter_json_array(text)) == [{"a": 1}, {"a": 2, "b": [1, 2]}]


def test_synthetic_workload_is_seeded_and_in_range():
    a = workloads.synthetic(1000, num_requests=32, seed=3)
    b = workloads.synthetic(1000, num_requests=32, seed=3)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert all(64 <= len(r.prompt_token_ids) <= 512 for r in a.requests)
    assert all(r.max_new_tokens == 256 for r in a.requests)
    assert all(0 <= t < 1000 for r in a.requests for t in r.prompt_token_ids)
    shared = workloads.shared_prefix(1000, num_requests=4)
    assert len({tuple(r.prompt_token_ids[:1024]) for r in shared.requests}) == 1


def test_workload_file_round_trip_folds_vocab(tmp_path):
    wl = workloads.Workload("x", [workloads.WorkloadRequest([5, 40000, 7], 9)])
    wl.save(tmp_path / "w.json")
    back = workloads.load_workload_file(tmp_path / "w.json", vocab_size=32000)
    assert back.requests[0].prompt_token_ids == [5, 8000, 7]
    assert back.requests[0].max_new_tokens == 9
    assert json.loads((tmp_path / "w.json").read_text())["name"] == "x"


def test_roofline_bounds_of_the_tinyllama_shape_on_the_h200():
    # weights + KV read per step at 4.2 TB/s: W1 ~190k output tok/s, batch 1 ~1.9k tok/s
    import torch

    model = models.build_random_model("tinyllama-1.1b", torch.bfloat16, torch.device("meta"))
    costs = roofline.model_costs(model)
    w1 = roofline.workload_bound(costs, workloads.synthetic(32000), 256, roofline.H200)
    b1 = roofline.workload_bound(costs, workloads.batch1(32000), 1, roofline.H200)
    assert 150e3 < w1["output_tok_s"] < 250e3
    assert 1.6e3 < b1["output_tok_s"] < 2.4e3


def test_report_merges_separate_invocations_with_ratios(tmp_path, capsys):
    common = ["--limit", "3", "--max-new-tokens", "2", "--no-progress", "--no-plots"]
    files = []
    for backend in ("paged", "hf"):
        out = tmp_path / backend
        assert run.main(["throughput", "--backend", backend, *common, "--out", str(out)]) == 0
        files += [str(p) for p in out.glob("throughput-*.json")]
    capsys.readouterr()
    assert run.main(["report", *files, "--out", str(tmp_path / "merged")]) == 0
    text = capsys.readouterr().out
    assert "| paged |" in text and "| hf |" in text
    assert "ratio paged (c=256) / hf (c=64)" in text
    assert "merged from separate invocations" in text
    # another workload cannot be merged into the same table
    other = tmp_path / "other"
    assert (
        run.main(
            ["throughput", "--backend", "hf", *common[:1], "4", *common[2:], "--out", str(other)]
        )
        == 0
    )
    capsys.readouterr()
    assert run.main(["report", files[0], *map(str, other.glob("*.json"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "workload differs" in err[0]
    assert run.main(["report", str(tmp_path / "nope.json")]) == 2


def test_engine_speed_options_default_on_and_can_be_turned_off(tmp_path):
    common = ["--limit", "2", "--max-new-tokens", "2", "--no-progress", "--no-plots"]
    seen = {}
    for name, flags in (
        ("default", []),
        ("off", ["--no-async-scheduling", "--no-fuse-projections", "--small-batch-rows", "0"]),
    ):
        out = tmp_path / name
        assert (
            run.main(["throughput", "--backend", "paged", *common, *flags, "--out", str(out)]) == 0
        )
        (path,) = out.glob("throughput-*.json")
        data = json.loads(path.read_text())
        engine = data["results"][0]["runs"][0]["metrics"]["extra"]["engine"]
        seen[name] = (
            engine["async_scheduling"],
            engine["fuse_projections"],
            engine["small_batch_forward"],
        )
    # the CPU runs the torch attention backend, where the small-batch forward is off either way;
    # the report says why: the backend, or the option passed through
    assert seen == {
        "default": (True, True, "off (attention backend 'torch', not 'triton')"),
        "off": (False, False, "off (small_batch_rows=0)"),
    }


def test_long_decode_workload():
    wl = workloads.build_workload("long-decode", 1000, None, 8192)
    assert len(wl.requests) == 256
    assert {len(r.prompt_token_ids) for r in wl.requests} == {4096}
    assert {r.max_new_tokens for r in wl.requests} == {512}
    assert all(0 <= t < 1000 for r in wl.requests for t in r.prompt_token_ids)


def test_bnb_option_runs_every_backend_on_the_bitsandbytes_model(
    tiny_model, monkeypatch, tmp_path, capsys
):
    # --bnb nf4: the model saved and loaded again with BitsAndBytesConfig, as a user loads one;
    # the engine and transformers' generate both run that quantised model (a tiny Llama here
    # in place of a named shape)
    pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(
        models,
        "_load_model",
        lambda *a: models.LoadedModel("tiny", tiny_model("llama"), None, False),
    )
    argv = ["throughput", "--device", "cpu", "--dtype", "float32", "--bnb", "nf4"]
    argv += ["--backend", "paged,hf", "--limit", "2", "--max-new-tokens", "3", "--no-progress"]
    assert run.main([*argv, "--no-plots", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tiny-bnb-nf4" in out
    assert len([line for line in out.splitlines() if line.startswith(("| paged", "| hf "))]) == 2
    assert run.main(["throughput", "--bnb", "nf5", "--out", str(tmp_path)]) == 2
