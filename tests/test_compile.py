"""torch.compile of the model forward (Engine(compile=True)): same greedy tokens as eager, and one
compilation for a whole run. Steps vary the token count, the number of kept logits rows (one
when a single prompt finishes) and send single tokens; none of that may compile the model again
(a recompile of a real 22-layer model costs ~35 s mid-run)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from hf_paged import Engine, SamplingParams


def _prompts():
    g = torch.Generator().manual_seed(0)
    lengths = [1, 5, 37, 80, 3, 120, 1, 64]
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("scope", ["model", "layers"])
def test_compiled_engine_matches_eager_and_compiles_once(tiny_model, scope):
    # two layers: under scope "layers" they must share one graph (layer index not a constant)
    model = tiny_model("llama", num_hidden_layers=2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    opts = dict(attention_backend="torch", block_size=16, max_num_batched_tokens=96)
    eager = Engine(model, compile=False, **opts)
    expected = [o.output_token_ids for o in eager.generate(_prompts(), params)]
    eager.shutdown()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = Engine(model, compile=True, compile_scope=scope, **opts)
    prompts = _prompts()
    # one prompt alone: a mixed step of one 1-token prompt, then one kept row with many tokens
    assert compiled.generate([prompts[0]], params)[0].output_token_ids == expected[0]
    assert compiled.generate([prompts[5]], params)[0].output_token_ids == expected[5]
    got = [o.output_token_ids for o in compiled.generate(prompts, params)]
    assert got == expected
    frames = torch._dynamo.utils.counters["frames"]
    assert compiled.runner.forward.compiled
    # compiled once (at the first forward), never again in the run
    assert frames["ok"] >= 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(frames)
    compiled.check_invariants()
    compiled.shutdown()  # the model goes back uncompiled, without our buffers
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    assert not any("hf_paged" in name for name, _ in model.named_buffers())


def test_compile_scope_is_validated(tiny_model):
    with pytest.raises(ValueError, match="compile_scope"):
        Engine(tiny_model("llama"), compile=True, compile_scope="everything")


def test_a_model_compile_cannot_handle_runs_eager_with_a_warning(tiny_model, monkeypatch):
    import hf_paged.worker.model_forward as model_forward

    model = tiny_model("llama", num_hidden_layers=1)
    prompts = _prompts()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = [o.output_token_ids for o in Engine(model).generate(prompts, params)]
    undone = []

    def failing_compile(m, scope):
        def forward(*args, **kwargs):
            raise torch._dynamo.exc.TorchDynamoException("inductor could not lower this model")

        return forward, lambda: undone.append(True)

    monkeypatch.setattr(model_forward, "compile_model", failing_compile)
    eng = Engine(model, compile=True)
    with pytest.warns(RuntimeWarning, match="torch.compile failed"):
        got = [o.output_token_ids for o in eng.generate(prompts, params)]
    assert got == want
    assert not eng.runner.forward.compiled and undone == [True]
    eng.check_invariants()
