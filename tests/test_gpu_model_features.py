"""GPU only: models that need sinks or unequal K/V head sizes through the whole engine path
(Triton kernels compiled, torch.compile of the layers, CUDA graphs, asynchronous scheduling:
the defaults) against transformers' generate, float32 greedy, at real attention head shapes
with few layers and random weights: gpt-oss's (64 q heads, 8 kv, head 64, sinks, 128-token
windows) and DeepSeek-V3's MLA (keys 192, values 128). Both are MoE models: in float32 their
grouped_mm experts run outside the compiled layers and the engine captures no CUDA graphs
(hf_paged/worker/moe_experts.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

COMMON = dict(
    vocab_size=32000, num_hidden_layers=2, max_position_embeddings=4096, pad_token_id=0,
    eos_token_id=1, bos_token_id=2,
)  # fmt: skip
SHAPES = {
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            hidden_size=1024, intermediate_size=1024, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=4,
            num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
            num_attention_heads=16, num_key_value_heads=16, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=256, q_lora_rank=384,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1,
        ),
    ),
}  # fmt: skip
LENGTHS = [1, 17, 100, 257, 500, 33]


def _model(name):
    cfg_name, model_name, shape = SHAPES[name]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_name)(**COMMON, **shape)
    with torch.device("cuda"):
        model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():  # separate greedy choices; sinks large enough to matter
        model.lm_head.weight.mul_(8.0)
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.copy_(torch.linspace(-1.0, 3.0, module.sinks.numel()))
    return model


@pytest.mark.parametrize("name", list(SHAPES))
def test_engine_defaults_match_transformers_fp32(name):
    model = _model(name)
    g = torch.Generator().manual_seed(0)
    longest = max(LENGTHS)
    ids = torch.zeros((len(LENGTHS), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        ids[i, longest - n :] = torch.randint(3, 32000, (n,), generator=g)
        mask[i, longest - n :] = 1
    ids, mask = ids.cuda(), mask.cuda()
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    ref = model.generate(**gen)
    hf_paged.patch(model)  # defaults: Triton, compiled layers, CUDA graphs, async scheduling
    try:
        out = model.generate(**gen)
        hf_paged.get_engine(model).check_invariants()
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)
