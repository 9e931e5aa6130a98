"""Multi-LoRA on the GPU (`pytest -m gpu tests/test_gpu_lora.py`): the engine's LoRA path with
its defaults (Triton shrink/expand, torch.compile, CUDA graphs for decode and mixed steps) against
the same engine with every speed option off and the torch references, and against peft itself.

TinyLlama-1.1B attention/MLP shapes with 4 layers, random weights; 8 adapters of rank 16 on all
seven projections (one of rank 12, zero-padded), requests spread over them and the base model.
float32 checks are exact (greedy tokens equal); bf16 must agree on every row's first token.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import hf_paged
from hf_paged import Engine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
peft = pytest.importorskip("peft")

SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PLAIN = dict(compile=False, cuda_graphs=False, async_scheduling=False)
LENGTHS = [1, 17, 64, 100, 257, 500, 33, 1000, 5, 40, 9, 300]


def _peft_model(dtype, num_adapters=8):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(dtype).eval()
    with torch.no_grad():
        base.lm_head.weight.mul_(8.0)
    model = None
    for i in range(num_adapters):
        rank = 12 if i == 3 else 16
        cfg = LoraConfig(r=rank, lora_alpha=32, target_modules=PROJECTIONS, use_rslora=i == 5)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name="a0", autocast_adapter_dtype=False)
        else:
            model.add_adapter(f"a{i}", cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            for lin in getattr(module, "lora_B", {}).values():
                lin.weight.normal_(std=0.05)
    return model.eval()


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (n,), generator=g).tolist() for n in LENGTHS]


def _names(count):
    return [None if i % 5 == 4 else f"a{i % 8}" for i in range(count)]


def _run(model, prompts, names, kernels=True, monkeypatch=None, **options):
    if not kernels:
        from hf_paged.lora import fold

        monkeypatch.setattr(fold, "USE_KERNELS", False)  # the torch references on the GPU
    eng = Engine(model, **options)
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, adapter=n) for n in names
    ]
    try:
        outs = eng.generate(prompts, params)
        eng.check_invariants()
        replays = dict(eng.runner.graphs.replays) if eng.runner.graphs is not None else None
    finally:
        eng.shutdown()
        if monkeypatch is not None:
            monkeypatch.undo()
    return [o.output_token_ids for o in outs], replays


def test_lora_kernels_graphs_and_compile_change_no_greedy_output_fp32(monkeypatch):
    model = _peft_model(torch.float32)
    prompts = _prompts()
    names = _names(len(prompts))
    want, _ = _run(model, prompts, names, kernels=False, monkeypatch=monkeypatch, **PLAIN)
    kernels, _ = _run(model, prompts, names, **PLAIN)
    assert kernels == want
    defaults, replays = _run(model, prompts, names)  # compile, graphs, async scheduling
    assert defaults == want
    assert replays["decode"] > 0  # LoRA decode steps ran from graphs
    # every projection folds its slots' A into its GEMM at this shape; the separate shrink
    # (each projection's own launch, hf_paged/lora/fold.py) gives the same tokens too
    from hf_paged.lora import fold

    with monkeypatch.context() as m:
        m.setattr(fold, "MAX_EXTRA_ROWS", 0.0)
        unfolded, _ = _run(model, prompts, names)
    assert unfolded == want
    # a 128-token budget: prefill chunks of several adapters share mixed graphs with decodes
    chunked, replays = _run(model, prompts, names, max_num_batched_tokens=128)
    assert chunked == want
    assert replays["mixed"] > 0


def test_rows_match_peft_alone_with_graphs_fp32():
    model = _peft_model(torch.float32, num_adapters=3)
    prompts = _prompts(seed=2)[:4]
    names = ["a0", None, "a2", "a1"]
    want = []
    for prompt, name in zip(prompts, names):
        ids = torch.tensor([prompt], device="cuda")
        if name is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
        else:
            model.set_adapter(name)
            out = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False)
        want.append(out[0, len(prompt) :].tolist())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eng = Engine(model)
    assert eng.runner.graphs is not None and eng.runner.forward.compiled
    params = [SamplingParams(max_tokens=24, temperature=0, adapter=n) for n in names]
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    eng.shutdown()
    assert got == want
    # the LoRA path traces whole: a graph break splits each compiled decoder layer (nothing
    # fuses across the pieces); the GPU host's dynamo broke where the CPU's does not
    assert not torch._dynamo.utils.counters["graph_break"]


def test_small_batch_forward_applies_each_rows_adapter_fp32(monkeypatch):
    """Batch 1 and 2 (the fused small-batch forward, in decode graphs) with adapters on all
    seven projections: the same tokens as the engine without the small-batch forward."""
    model = _peft_model(torch.float32, num_adapters=3)
    prompts = _prompts(seed=4)[:4]
    names = ["a0", None, "a2", "a1"]
    want, _ = _run(model, prompts, names, small_batch_rows=0)
    eng = Engine(model)
    assert eng.runner.forward.small_batch is not None, eng.runner.forward.small_batch_status
    eng.shutdown()
    alone = [_run(model, [p], [n])[0][0] for p, n in zip(prompts, names)]  # batch 1
    pairs = _run(model, prompts[:2], names[:2])[0] + _run(model, prompts[2:], names[2:])[0]
    assert alone == want and pairs == want


def test_bf16_first_tokens_agree_with_the_torch_references(monkeypatch):
    model = _peft_model(torch.bfloat16)
    prompts = _prompts(seed=3)
    names = _names(len(prompts))
    ref, _ = _run(model, prompts, names, kernels=False, monkeypatch=monkeypatch, **PLAIN)
    got, _ = _run(model, prompts, names)
    first = sum(g[0] == r[0] for g, r in zip(got, ref)) / len(ref)
    rows = sum(g == r for g, r in zip(got, ref)) / len(ref)
    print(f"bf16 LoRA: first tokens equal {first:.0%}, whole rows equal {rows:.0%}")
    assert first >= 0.9


def test_slots_reload_between_graph_replays_fp32():
    # one slot, three adapters one after another: each copy into the slot is seen by the next
    # replay of the same captured graphs
    model = _peft_model(torch.float32, num_adapters=3)
    prompt = _prompts(seed=4)[1]
    ref = {}
    for name in ["a0", "a1", "a2"]:
        model.set_adapter(name)
        out = model.generate(input_ids=torch.tensor([prompt], device="cuda"), max_new_tokens=12)
        ref[name] = out[0, len(prompt) :].tolist()
    hf_paged.patch(model, max_loras=1)
    try:
        eng = hf_paged.get_engine(model)
        for name in ["a0", "a1", "a2", "a0"]:
            params = SamplingParams(max_tokens=12, temperature=0, adapter=name)
            assert eng.generate([prompt], params)[0].output_token_ids == ref[name], name
        assert eng.runner.graphs.replays["decode"] > 0
    finally:
        hf_paged.unpatch(model)
