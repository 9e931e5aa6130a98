"""The server's throughput must-show on the GPU: serve-bench on W1 (TinyLlama-1.1B shape,
random weights, bfloat16) at 256 streaming clients reaches >= 90% of the offline engine's output
tok/s, and batch-1 TPOT is within 10% of the offline engine's, in one run."""

from __future__ import annotations

import json

import pytest
import torch

from hf_paged.testing import load_evals

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

run = load_evals()


def test_server_keeps_up_with_the_offline_engine_at_256_streams(tmp_path, capsys):
    argv = ["serve-bench", "--model", "tinyllama-1.1b", "--dtype", "bfloat16", "--device"]
    argv += ["cuda", "--dataset", "synthetic,batch1", "--clients", "256", "--no-progress"]
    assert run.main([*argv, "--out", str(tmp_path)]) == 0
    print(capsys.readouterr().out)  # the table, for the log
    (path,) = tmp_path.glob("serve-bench-*.json")
    results = json.loads(path.read_text())["results"]
    by_clients = {r["clients"]: {m["backend"]: m for m in r["metrics"]} for r in results}
    w1, batch1 = by_clients[256], by_clients[1]
    ratio = w1["server"]["output_tok_s"] / w1["offline"]["output_tok_s"]
    assert ratio >= 0.9, f"server / offline output tok/s at 256 clients: {ratio:.2f}"
    tpot = batch1["server"]["tpot_p50_ms"] / batch1["offline"]["tpot_p50_ms"]
    assert tpot <= 1.1, f"batch-1 TPOT p50 server / offline: {tpot:.2f}"
