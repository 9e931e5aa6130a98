"""GPU only: `evals/run.py startup` on a small Llama at real head shapes (bf16): every GPU phase
of the breakdown is timed, and the second process compiles from the first one's caches
(HF_PAGED_COMPILE_CACHE). Two fresh processes; about 2 minutes on the H200 with cold caches."""

from __future__ import annotations

import json

import pytest
import torch

from hf_paged.testing import load_evals
from hf_paged.worker.startup_times import PHASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_second_process_compiles_from_the_first_ones_cache(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip
    folder = tmp_path / "model"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    argv = ["startup", "--model", str(folder), "--dtype", "bfloat16", "--device", "cuda"]
    argv += ["--prompt-len", "256", "--cache-dir", str(tmp_path / "cc"), "--out", str(tmp_path)]
    # fewer graphs than the defaults: the phases are what is checked, not their sizes
    argv += ["--engine-option", "max_graph_batch_size=8", "--engine-option", "max_graph_tokens=256"]
    assert load_evals().main(argv) == 0
    runs = json.loads(next(tmp_path.glob("startup-*.json")).read_text())["runs"]
    cold, warm = runs["cold"], runs["warm"]
    for run in (cold, warm):
        stats = run["startup"]
        assert sum(stats[f"{p}_s"] for p in PHASES) == pytest.approx(stats["total_s"], abs=1e-6)
        for phase in ("kv_sizing", "compile", "kernel_warm_up", "graph_capture", "verify_model"):
            assert stats[f"{phase}_s"] > 0, phase
        assert stats["decode_graphs"] == 4 and stats["mixed_graphs"] > 0
        assert 0 < run["warm_ttft_s"] and 0 < run["first_ttft_s"]
    assert cold["cache_files"]["inductor"] > 0 and cold["cache_files"]["triton"] > 0
    # the warm process found inductor's generated code and the kernels' binaries on disk
    assert warm["startup"]["compile_s"] < cold["startup"]["compile_s"]
    assert warm["startup"]["kernel_warm_up_s"] < cold["startup"]["kernel_warm_up_s"]
