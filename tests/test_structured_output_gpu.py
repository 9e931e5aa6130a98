"""Structured output on a CUDA GPU (`pytest -m gpu tests/test_structured_output_gpu.py`): the
device bitmask kernel against a torch reference, and an engine with CUDA graphs and
asynchronous scheduling whose constrained outputs match and whose unconstrained greedy rows are
unchanged by the constrained rows beside them."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_kernel_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 64, 32000
    logits = torch.randn(rows, vocab, generator=gen).to(dtype).cuda()
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)
    sel = list(range(0, rows, 3))
    bits = ((bitmask[:, :, None] >> torch.arange(32)) & 1).reshape(rows, -1)[:, :vocab].bool()
    want = logits.clone()
    for i in sel:
        want[i].masked_fill_(~bits[i].cuda(), float("-inf"))
    got = logits.clone()
    xgr.apply_token_bitmask_inplace(got, bitmask.cuda(), vocab_size=vocab, indices=sel)
    assert torch.equal(got, want)


def test_engine_with_graphs_and_async():
    conftest = sys.modules["tests.conftest"]
    structured = pytest.importorskip("tests.test_structured_output")
    from hf_paged import Engine, SamplingParams, StructuredOutputs

    tok = structured.json_tokenizer()
    model = conftest.build_model("llama").cuda()
    plain = SamplingParams(max_tokens=24, temperature=0)
    prompts = ["the cat", "a dog ran", "hello"]
    first = Engine(model, tok, max_num_seqs=16)
    ref = first.generate(prompts, plain)
    first.shutdown()  # its KV cache holds most of the GPU's memory: free it for the next engine
    eng = Engine(model, tok, max_num_seqs=16, async_scheduling=True)
    schema = structured.SCHEMA
    params = [
        SamplingParams(
            max_tokens=80, temperature=0.7, seed=i, structured=StructuredOutputs(json=schema)
        )
        for i in range(8)
    ]
    params.append(SamplingParams(max_tokens=20, structured=StructuredOutputs(regex=r"\d{4}")))
    outs = eng.generate(prompts + ["x"] * len(params), [plain] * 3 + params)
    assert [o.output_token_ids for o in outs[:3]] == [o.output_token_ids for o in ref]
    for out in outs[3:-1]:
        jsonschema.validate(json.loads(structured.text(tok, out)), schema)
    assert re.fullmatch(r"\d{4}", structured.text(tok, outs[-1]))
    eng.check_invariants()
    eng.shutdown()  # the next test's engines size their KV cache from the free memory


def test_deferred_sampling_matches_the_synchronous_engine_with_graphs():
    """Under asynchronous scheduling a constrained step's sampling is queued after the next
    step's preparation, just before its forward (CUDA-graph replays included): greedy tokens
    equal the synchronous engine's, constrained and unconstrained rows alike."""
    conftest = sys.modules["tests.conftest"]
    structured = pytest.importorskip("tests.test_structured_output")
    from hf_paged import Engine, SamplingParams, StructuredOutputs

    tok = structured.json_tokenizer()
    model = conftest.build_model("llama").cuda()
    params = [
        SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutputs(json=s))
        for s in (structured.SCHEMA, {"type": "array", "items": {"type": "integer"}})
    ]
    params += [SamplingParams(max_tokens=16, temperature=0)] * 2
    regex = StructuredOutputs(regex=r"[a-f]{6}")
    params.append(SamplingParams(max_tokens=20, temperature=0, structured=regex))  # greedy too
    prompts = [f"prompt {i}" for i in range(len(params))]
    runs = []
    for async_scheduling in (False, True):
        eng = Engine(model, tok, max_num_seqs=16, async_scheduling=async_scheduling)
        runs.append([o.output_token_ids for o in eng.generate(prompts, params)])
        eng.check_invariants()
        eng.shutdown()
    assert runs[0] == runs[1]
