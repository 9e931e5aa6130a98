"""`evals/run.py serve-soak`: the flat-memory rule tells a leak from noise, and a short soak of
the real `hf-paged serve` process (streams, n = 2, dropped streams, bad requests; the base and
two LoRA adapters) ends with no error, every block back in the pool and its memory flat."""

from __future__ import annotations

import json
import random

import pytest

from hf_paged.testing import load_evals

run = load_evals()


def _series(growth_per_s: float, noise: float, seconds: int = 300, interval: int = 5):
    rng = random.Random(0)
    times = list(range(0, seconds + 1, interval))
    base = 600 * (1 << 20)
    rss = [base * (1 + growth_per_s * t + rng.uniform(-noise, noise)) for t in times]
    return times, rss, seconds


def test_flat_memory_rule():
    from hf_paged_evals.errors import EvalError
    from hf_paged_evals.serve_soak import flat_memory

    assert flat_memory(*_series(0.0, 0.005))["pass"]  # +-0.5% noise, no trend
    # 1% a minute (6 MiB/min on 600 MiB): 4 minutes after warm-up put it past 2%
    leak = flat_memory(*_series(0.01 / 60, 0.002))
    assert not leak["pass"] and leak["trend_pct"] > 2
    # a step up after the warm-up window that stays: the late median shows it
    times, rss, seconds = _series(0.0, 0.0)
    step = [r * (1.03 if t > 150 else 1.0) for t, r in zip(times, rss)]
    assert not flat_memory(times, step, seconds)["pass"]
    with pytest.raises(EvalError, match="too few memory samples"):
        flat_memory([0, 1], [1.0, 1.0], 300)  # too few samples: no verdict


@pytest.mark.parametrize("mode", [[], ["--engine-process"]], ids=["thread", "process"])
def test_short_soak(tmp_path, capsys, mode):
    pytest.importorskip("peft")
    argv = ["serve-soak", "--minutes", "0.3", "--clients", "3", "--interval", "1.5"]
    argv += ["--adapters", "2"]  # requests spread over the base and two LoRA adapters
    argv += ["--out", str(tmp_path), *mode]
    assert run.main(argv) == 0, capsys.readouterr().out
    (path,) = tmp_path.glob("serve-soak-*.json")
    result = json.loads(path.read_text())
    assert result["pass"] and result["num_errors"] == 0 and result["drained"]
    assert result["memory"]["pass"]
    if mode:  # the engine process's memory watched too
        assert result["engine_memory"]["pass"]
        assert all(s["engine_rss_mib"] > 0 for s in result["samples"])
    # every kind of request ran, and the sampler saw work in flight
    assert set(result["outcomes"]) == {"stream", "full", "disconnect", "bad"}
    assert max(s["in_flight"] for s in result["samples"]) > 0
    end = result["end"]
    assert end["kv_usage"] == 0 and end["in_flight"] == 0 and end["running"] == 0


def test_soak_bad_options(tmp_path, capsys):
    argv = ["serve-soak", "--model", str(tmp_path / "none"), "--out", str(tmp_path)]
    assert run.main(argv) == 2
    assert "--model" in capsys.readouterr().err
    argv = ["serve-soak", "--model", str(tmp_path), "--adapters", "1", "--out", str(tmp_path)]
    assert run.main(argv) == 2
    assert "--adapters" in capsys.readouterr().err
