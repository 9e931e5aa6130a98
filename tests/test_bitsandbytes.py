"""bitsandbytes models as transformers loads them (4-bit nf4/fp4, double quant, float32 and
bfloat16 compute; 8-bit LLM.int8) under the engine on CPU: greedy output identical to
transformers' own generate of the same quantised model, fused projections skipped, LLM.int8
layers named as what blocks CUDA graphs and kept out of torch.compile. The GPU run
(graphs on for 4-bit, off with a warning for 8-bit): test_bnb_int8_gpu_no_crash below."""

from __future__ import annotations

import warnings

import bitsandbytes  # noqa: F401  (the `test` extra installs it: these tests need it)
import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import hf_paged
from hf_paged.worker.compilation import compile_model
from hf_paged.worker.graph_blockers import graph_blocker

CONFIGS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4_double_quant": dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="fp4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    ),
    "nf4_bf16_compute": dict(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import build_model

    path = tmp_path_factory.mktemp("tiny_llama")
    build_model("llama").save_pretrained(path)
    return path


def load(path, name: str, device: str = "cpu"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' notes on CPU kernels and casts
        return AutoModelForCausalLM.from_pretrained(
            path,
            quantization_config=BitsAndBytesConfig(**CONFIGS[name]),
            device_map=device,
            dtype=torch.float32,
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_parity_with_transformers_bnb_generate(name, saved_llama, batch_factory):
    model = load(saved_llama, name)
    ids, mask = batch_factory([3, 12, 30])
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    hf_paged.patch(model)
    try:
        engine = hf_paged.get_engine(model)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
        engine.check_invariants()
        assert engine.num_fused_projections == 0  # bitsandbytes layers are never fused
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)


def test_int8_layers_named_as_graph_blockers_and_run_eagerly(saved_llama):
    model = load(saved_llama, "int8")
    reason = graph_blocker(model)
    assert reason is not None and "Linear8bitLt" in reason
    int8 = [m for m in model.modules() if type(m).__name__ == "Linear8bitLt"]
    _, undo = compile_model(model, "layers")
    assert int8 and all("forward" in m.__dict__ for m in int8)  # outside the compiled graph
    undo()
    assert not any("forward" in m.__dict__ for m in int8)
    assert graph_blocker(load(saved_llama, "nf4")) is None  # 4-bit layers are captured


def test_fp8_on_a_bnb_model_refused(saved_llama):
    with pytest.raises(ValueError, match="already quantised"):
        hf_paged.Engine(load(saved_llama, "nf4"), quantization="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bnb_gpu_no_crash(name, saved_llama, batch_factory):
    # the H200 crash: LLM.int8 inside CUDA graph capture. Now graphs go off with a warning
    # naming Linear8bitLt; 4-bit models keep graphs and compile. Output as transformers'.
    model = load(saved_llama, name, device="cuda")
    ids, mask = (t.cuda() for t in batch_factory([3, 12, 30]))
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_paged.patch(model)
    try:
        engine = hf_paged.get_engine(model)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
        engine.check_invariants()
        blocked = [w for w in caught if "CUDA graphs off" in str(w.message)]
        if name == "int8":
            assert engine.runner.graphs is None and "Linear8bitLt" in str(blocked[0].message)
        else:
            assert engine.runner.graphs is not None and not blocked
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)  # float32 compute (LLM.int8: fp16 inside, in both runs)
