"""The coverage report (evals/coverage.py) on a fast subset: exact or refused, never differs or
crashed. The whole enumeration runs as `python evals/run.py coverage` (evals/RESULTS.md)."""

from __future__ import annotations

import importlib

import pytest

from hf_paged.testing import load_evals

run = load_evals()
coverage = importlib.import_module("hf_paged_evals.coverage")

# type -> the class it must end in, and why it is in the subset
SUBSET = {
    "llama": "exact",
    "qwen2": "exact",  # q/k/v biases
    "gemma2": "exact",  # softcaps, alternating 32-token windows under 37- and 90-token prompts
    "diffllama": "refused",  # two attention calls per layer: the start-up check's decode step
    "doge": "refused",  # its window only in the mask: the check's prompt past the window
    "bloom": "exact",  # ALiBi, inline attention: forward swapped; no length limit: retried
    "xlm": "refused",  # standard attention, but its model zeroes hidden states by pad_index
    "roformer": "exact",  # no AttentionInterface: its BERT-style forward swapped, own rotary
    "hy_v4": "refused",  # a sparse-attention indexer reading the mask: a TypeError, refused
    "gpt_oss": "exact",  # attention sinks (s_aux)
    "deepseek_v3": "exact",  # MLA: keys 24 wide, values 16, heads other than the config's
    "deepseek_v4": "refused",  # compressed KV entries appended to the keys: refused at the probe
    "roberta": "exact",  # position ids as generate passes them, not padding_idx + 1 onwards
    "stablelm": "exact",  # routes attention through the interface without the class flag
    "blenderbot-small": "exact",  # positions built inside the decoder: the step's positions
    # unscaled attention: float32 rounding past the comparison, as transformers' eager is
    "gemma4": "rounding",
}


def test_fast_subset_is_exact_rounding_or_refused(one_torch_thread):
    rows = coverage.run_coverage(list(SUBSET), progress=False)
    got = {r.model_type: r.status for r in rows}
    counts = coverage.counts(rows)
    assert counts["differs"] == 0 and counts["crashed"] == 0, coverage.format_table(rows)
    assert got == SUBSET, coverage.format_table(rows)
    details = {r.model_type: r.detail for r in rows}
    assert "at the decode step" in details["diffllama"]
    assert "already in the prompt forward" in details["doge"]
    assert "pad_index" in details["xlm"]
    assert details["bloom"] == "with max_model_len=512"
    assert "fails in a paged forward (TypeError" in details["hy_v4"]
    assert "more keys than its" in details["deepseek_v4"]


def test_table_lists_counts_and_every_row():
    rows = [
        coverage.Row("llama", "exact"),
        coverage.Row("bloom", "refused", "ValueError: no | AttentionInterface"),
    ]
    table = coverage.format_table(rows)
    assert "| exact | 1 |" in table and "| refused | 1 |" in table and "| differs | 0 |" in table
    assert "| bloom | refused | no \\| AttentionInterface |" in table


def test_short_detail_drops_what_the_row_names():
    detail = "ValueError: model: DogeForCausalLM (model_type 'doge') computes different logits " * 3
    short = coverage.short_detail(detail, width=60)
    assert short.startswith("computes different logits") and short.endswith(" ...")
    assert len(short) <= 64


def test_unknown_type_is_one_error_line(capsys, tmp_path):
    assert run.main(["coverage", "--types", "llama,nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model type(s) ['nope']" in err[0]


@pytest.mark.parametrize("model_type", ["gemma3", "gemma4_assistant"])
def test_non_text_types_are_skipped_with_the_reason(model_type):
    reason = coverage.skip_reason(model_type)
    assert reason is not None and ("multimodal" in reason or "drafter" in reason)
