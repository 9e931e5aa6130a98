"""Multi-LoRA on CPU, float32: a PeftModel with three adapters of different ranks and target
modules, a batch whose rows use different adapters (and some the base), row by row the same
greedy tokens as peft with that adapter alone; prefix caching keeps adapters apart; bad adapter
names are refused."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams
from tests.conftest import fold_lora_shrinks, peft_generate_alone

peft = pytest.importorskip("peft")


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("folded", [False, True])
def test_each_row_gets_its_own_adapter(peft_model, monkeypatch, folded):
    fold_lora_shrinks(monkeypatch, folded)
    model = peft_model()
    weights = {n: (p.data_ptr(), p.clone()) for n, p in model.named_parameters()}
    prompts = _prompts([7, 19, 12, 30, 9])
    names = ["math", None, "chat", "code", "math"]
    want = [peft_generate_alone(model, p, n, 8) for p, n in zip(prompts, names)]
    assert len({tuple(w) for w in want[:4]}) == 4  # the adapters change the output
    eng = Engine(model, max_num_batched_tokens=32)  # chunked prefill mixes adapters in steps
    params = [
        SamplingParams(max_tokens=8, temperature=0, adapter=n)
        for n in names  # eos stops, as peft
    ]
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    assert got == want
    eng.check_invariants()
    eng.shutdown()
    # the model's own forward is peft's again, its weights what they were, in storage of their
    # own (a folded projection's weight was a view of its extended GEMM's rows)
    assert not any("_hf_paged_peft_forward" in m.__dict__ for m in model.modules())
    unfused = ("o_proj.base_layer.weight", "down_proj.base_layer.weight")  # (q/k/v: views)
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name][1]), name
        if name.endswith(unfused):
            assert p.untyped_storage().nbytes() == p.nbytes, name
    moved = [n for n, p in model.named_parameters() if p.data_ptr() != weights[n][0]]
    assert any(n.endswith(unfused) for n in moved) == folded


def test_prefix_cache_is_shared_within_an_adapter_only(peft_model):
    model = peft_model()
    prompt = _prompts([40], seed=3)[0]
    eng = Engine(model, block_size=8)

    def cached(name):
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, adapter=name)
        return eng.generate([prompt], params)[0].num_cached_tokens

    assert cached("math") == 0
    assert cached("chat") == 0  # another adapter: no sharing
    assert cached(None) == 0  # the base model neither
    # the same adapter shares its 4 full prompt blocks (the last prompt token is always computed)
    assert cached("math") == 32
    eng.shutdown()


def test_generate_adapter_names_as_peft(peft_model):
    import hf_paged

    model = peft_model()
    prompts = _prompts([6, 6, 6], seed=4)
    names = ["chat", "__base__", "code"]
    want = [
        peft_generate_alone(model, p, None if n == "__base__" else n, 5)
        for p, n in zip(prompts, names)
    ]
    hf_paged.patch(model)
    try:
        out = model.generate(
            input_ids=torch.tensor(prompts), max_new_tokens=5, do_sample=False, adapter_names=names
        )
    finally:
        hf_paged.unpatch(model)
    # a row that ended at eos is padded (pad_token_id 0), as transformers pads it
    assert out[:, 6:].tolist() == [w + [0] * (5 - len(w)) for w in want]


def test_unknown_adapter_names_are_refused(peft_model, tiny_model):
    model = peft_model()
    eng = Engine(model)
    with pytest.raises(ValueError, match="adapter: unknown adapter 'zz'"):
        eng.add_request([1, 2, 3], SamplingParams(adapter="zz"))
    with pytest.raises(ValueError, match="adapter must be"):
        SamplingParams(adapter=3)
    plain = Engine(tiny_model("llama"))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        plain.add_request([1, 2, 3], SamplingParams(adapter="math"))
    assert not eng.has_unfinished_requests() and not plain.has_unfinished_requests()
    eng.shutdown()
    plain.shutdown()


@pytest.mark.parametrize("folded", [False, True])
def test_adapter_loaded_while_the_engine_runs(peft_model, lora_b, monkeypatch, folded):
    # folded: the layers routed at start-up compute their shrink in the base GEMM, the layers
    # peft wraps later (k_proj) a separate one
    from peft import LoraConfig

    fold_lora_shrinks(monkeypatch, folded)
    model = peft_model()
    eng = Engine(model)
    prompt = _prompts([10], seed=6)[0]
    running = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, adapter="math"))
    eng.step()
    # k_proj: no adapter targeted it, so peft wraps new layers the engine must route too
    model.add_adapter("docs", LoraConfig(r=2, target_modules=["q_proj", "k_proj"]))
    lora_b(model, "docs")
    late = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, adapter="docs"))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.output_token_ids
    assert outs[running] == peft_generate_alone(model, prompt, "math", 6)
    model.set_adapter("docs")
    assert outs[late] == peft_generate_alone(model, prompt, "docs", 6)
    eng.shutdown()


def test_pipeline_adapter_name(peft_model):
    import transformers

    import hf_paged
    from hf_paged.testing import tiny_tokenizer

    model, tok = peft_model(), tiny_tokenizer()
    texts = ["hello there", "the quick brown fox"]
    gen = dict(max_new_tokens=6, do_sample=False)
    ref = transformers.pipeline("text-generation", model=model, tokenizer=tok)
    model.set_adapter("chat")
    want_chat = ref(texts, **gen)
    with model.disable_adapter():
        want_base = ref(texts, **gen)
    assert want_chat != want_base
    pipe = hf_paged.pipeline("text-generation", model=model, tokenizer=tok)
    try:
        model.set_adapter("math")  # the engine's choice is per call, not peft's active adapter
        assert pipe(texts, adapter_name="chat", **gen) == want_chat
        assert pipe(texts, adapter_names=["__base__", "__base__"], **gen) == want_base
        assert pipe(texts[0], adapter_name="chat", **gen) == want_chat[0]
        with pytest.raises(ValueError, match="adapter_name: give adapter_name or"):
            pipe(texts, adapter_name="chat", adapter_names=["chat", "chat"], **gen)
    finally:
        hf_paged.unpatch(model)


def test_generate_without_adapter_names_runs_peft_active_adapter(peft_model):
    import hf_paged

    model = peft_model()
    prompts = _prompts([7, 7], seed=11)
    model.set_adapter("code")
    want = [peft_generate_alone(model, p, "code", 5) for p in prompts]
    base = [peft_generate_alone(model, p, None, 5) for p in prompts]
    assert want != base
    model.set_adapter("code")
    hf_paged.patch(model)
    try:
        out = model.generate(input_ids=torch.tensor(prompts), max_new_tokens=5, do_sample=False)
        with model.disable_adapter():  # peft's base model: no adapter for the engine either
            out_base = model.generate(
                input_ids=torch.tensor(prompts), max_new_tokens=5, do_sample=False
            )
        with pytest.raises(ValueError, match="num_beams: beam search with a LoRA adapter"):
            model.generate(input_ids=torch.tensor(prompts), max_new_tokens=2, num_beams=2)
    finally:
        hf_paged.unpatch(model)
    # rows that ended at eos are padded (pad_token_id 0)
    assert out[:, 7:].tolist() == [w + [0] * (5 - len(w)) for w in want]
    assert out_base[:, 7:].tolist() == [w + [0] * (5 - len(w)) for w in base]
