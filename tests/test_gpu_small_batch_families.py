"""Ladder step 4 (GPU only): the small-batch forward of Qwen3, Phi-3 and Gemma 2 at real layer
shapes (hidden, heads, head_dim, intermediate as the released models; 2 layers, random weights,
float32). Batch-1 and batch-2 decodes through the fused kernels must give transformers'
generate's greedy tokens and its log-probs (top 5 of each step) to within fp32 summation order.

In the README's small-batch group (`pytest -m "gpu and small_batch" tests/test_gpu_*.py`); each
test should take well under a minute on the H200 with a cold compile cache (no torch.compile;
Gemma 2 with CUDA graphs, the others without).
"""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.small_batch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYERS = dict(num_hidden_layers=2, vocab_size=32000, max_position_embeddings=4096)
# name -> (conftest architecture, the released model's layer shape, engine options)
SHAPES = {
    "qwen3-8b": (
        "qwen3",
        dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128),
        {},
    ),
    # Phi-3-mini: head_dim 96 (RoPE in a padded tile, cos/sin per step); a window under the
    # prompt (the released 2047 would not bind at these lengths)
    "phi3-mini": (
        "phi3",
        dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
             num_key_value_heads=32, sliding_window=48),
        {},
    ),
    # Gemma-2-2B: head_dim 256, softcaps 50 / 30, query_pre_attn_scalar 256; every other
    # layer a window under the prompt; decodes replayed from CUDA graphs
    "gemma2-2b": (
        "gemma2",
        dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
             attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=48),
        {"cuda_graphs": True},
    ),
}  # fmt: skip
ENGINE = dict(compile=False, cuda_graphs=False, num_blocks=64, max_num_seqs=4, small_batch_rows=2)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_small_batch_forward_at_real_layer_shapes_matches_transformers_fp32(tiny_model, name):
    arch, shape, options = SHAPES[name]
    model = tiny_model(arch, **{**LAYERS, **shape}).cuda()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (80, 61)]
    new = 12
    want = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).cpu()
        want.append((out.sequences[0, len(prompt) :].tolist(), logprobs))
    eng = Engine(model, **{**ENGINE, **options})
    forward = eng.runner.forward
    assert forward.small_batch is not None, forward.small_batch_status
    fast, rows = forward.small_batch, []
    real_call = type(fast).__call__

    class Counting(type(fast)):  # rows of each fused forward (graph capture calls it too)
        def __call__(self, ids, pos, keep):
            rows.append(pos.shape[0])
            return real_call(self, ids, pos, keep)

    fast.__class__ = Counting
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=5)
    for batch in ([0], [0, 1]):  # batch 1, then batch 2
        rows.clear()
        outs = eng.generate([prompts[i] for i in batch], params)
        if not options.get("cuda_graphs"):  # replays do not call it
            assert rows == [len(batch)] * (new - 1)
        for i, out in zip(batch, outs):
            tokens, logprobs = want[i]
            assert out.output_token_ids == tokens, (name, batch)
            for step, top in enumerate(out.logprobs):
                for tok, lp in top.items():
                    assert lp == pytest.approx(logprobs[step, tok].item(), abs=2e-3), (name, step)
    if options.get("cuda_graphs"):  # decodes of <= 2 rows replay graphs of the fused forward
        assert eng.runner.graphs.replays["decode"] > 0
    eng.check_invariants()
    eng.shutdown()
