"""transformers' grouped_mm MoE experts under the engine's compile and CUDA graphs
(hf_paged/worker/moe_experts.py): on weights that are not bfloat16 they run outside the compiled
graph and block graph capture, named; bfloat16 experts and dense models are left alone. The GPU
run of such models through every default: tests/test_gpu_model_features.py."""

from __future__ import annotations

import torch

from hf_paged.worker.compilation import compile_model
from hf_paged.worker.moe_experts import graph_blocker, uncapturable_experts


def test_float32_grouped_mm_experts_block_graphs_and_stay_eager(tiny_model):
    model = tiny_model("gpt_oss")
    experts = uncapturable_experts(model)
    assert len(experts) == model.config.num_hidden_layers
    reason = graph_blocker(model)
    assert reason is not None and "GptOssExperts" in reason and "torch.float32" in reason
    _, undo = compile_model(model, "layers")
    assert all("forward" in e.__dict__ for e in experts)  # eager inside the compiled layers
    undo()
    assert not any("forward" in e.__dict__ for e in experts)


def test_bfloat16_experts_and_dense_models_capture(tiny_model):
    assert graph_blocker(tiny_model("gpt_oss", dtype=torch.bfloat16)) is None
    model = tiny_model("gpt_oss")
    model.set_experts_implementation("batched_mm")
    assert graph_blocker(model) is None
    assert graph_blocker(tiny_model("llama")) is None
