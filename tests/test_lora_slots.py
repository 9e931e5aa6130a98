"""Multi-LoRA through the stacked slot buffers (hf_paged/lora/slots.py), CPU, float32: the
Triton kernels (interpreted) inside an engine step give peft's tokens; more adapters than slots
over time reuse slots, more at once wait for a seat (refused at add_request only with two Engines
on the model); max_lora_rank and max_loras are
validated; a removed adapter finishes its running requests and frees its slot; torch.compile runs
the LoRA path with one graph; the buffers leave with the engine."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams
from tests.conftest import fold_lora_shrinks, peft_generate_alone

peft = pytest.importorskip("peft")


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _params(name, max_tokens=5):
    # stops at eos, as generate does
    return SamplingParams(max_tokens=max_tokens, temperature=0, adapter=name)


@pytest.mark.parametrize("folded", [False, True])
def test_kernels_in_an_engine_step_give_peft_tokens(peft_model, monkeypatch, folded):
    # folded: the expand reads each token's slot's columns out of the extended base GEMM
    from hf_paged.lora import fold

    fold_lora_shrinks(monkeypatch, folded)
    monkeypatch.setattr(fold, "USE_KERNELS", True)  # Triton's interpreter on CPU tensors
    model = peft_model()
    prompts = _prompts([9, 4, 6, 5], seed=1)
    names = ["chat", None, "code", "math"]
    want = [peft_generate_alone(model, p, n, 3) for p, n in zip(prompts, names)]
    eng = Engine(model, max_num_batched_tokens=16, max_loras=4)  # prefill chunks mix adapters
    got = [o.output_token_ids for o in eng.generate(prompts, [_params(n, 3) for n in names])]
    assert got == want
    eng.shutdown()


@pytest.mark.parametrize("kernels, folded", [(False, False), (True, False), (True, True)])
def test_graph_inputs_carry_each_tokens_slot(peft_model, monkeypatch, kernels, folded):
    # the CUDA-graph runner's static padded buffers, run without capture on the CPU: decode
    # batches padded to a bucket and mixed steps padded to a token bucket, the adapter slots a
    # packed input (padding: -1) grouped by slot inside the graph's forward
    from hf_paged.lora import fold
    from hf_paged.worker.cuda_graphs import CudaGraphRunner

    fold_lora_shrinks(monkeypatch, folded)
    monkeypatch.setattr(fold, "USE_KERNELS", kernels)
    model = peft_model()
    prompts = _prompts([9, 3, 14], seed=8)
    names = ["code", "chat", None]
    want = [peft_generate_alone(model, p, n, 4) for p, n in zip(prompts, names)]
    eng = Engine(model, attention_backend="triton", max_num_batched_tokens=32, max_num_seqs=3)
    eng.runner.graphs = CudaGraphRunner(eng.runner, eager=True)
    eng.runner.graphs.capture()
    got = [o.output_token_ids for o in eng.generate(prompts, [_params(n, 4) for n in names])]
    replays = dict(eng.runner.graphs.replays)
    eng.shutdown()
    assert got == want
    assert replays["decode"] > 0 and replays["mixed"] > 0


def test_more_adapters_over_time_than_slots_reuse_them(peft_model):
    model = peft_model()
    prompt = _prompts([11], seed=2)[0]
    eng = Engine(model, max_loras=1)
    routing = eng.core.lora
    for name in ["math", "chat", None, "code", "math"]:
        out = eng.generate([prompt], _params(name))[0].output_token_ids
        assert out == peft_generate_alone(model, prompt, name, 5), name
        if name is not None:
            assert routing.slots.slot_of == {name: 0}  # the one slot, copied again each time
    eng.check_invariants()
    eng.shutdown()


def test_more_adapters_at_once_than_slots_wait_for_a_seat(peft_model):
    # vLLM's max_loras per step: requests of a third adapter wait in the queue until a running
    # adapter's requests have ended; the base model and the running adapters go on meanwhile
    model = peft_model()
    prompts = _prompts([5, 6, 7, 4, 8], seed=3)
    names = ["math", "chat", None, "code", "math"]
    eng = Engine(model, max_loras=2)
    ids = [eng.add_request(p, _params(n, 6 if n == "chat" else 4)) for p, n in zip(prompts, names)]
    steps = []  # the adapters of every scheduled step
    schedule = eng.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append({r.sampling_params.adapter for r in out.requests} - {None})
        return out

    eng.scheduler.schedule = recorded
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.output_token_ids
    assert max(len(s) for s in steps) == 2  # never a third adapter in a step
    assert steps[0] == {"math", "chat"}  # code waited, the last math request did not
    assert any("code" in s for s in steps)  # and it ran once a seat was free
    for rid, prompt, name in zip(ids, prompts, names):
        n = 6 if name == "chat" else 4
        assert done[rid] == peft_generate_alone(model, prompt, name, n), name
    eng.check_invariants()
    eng.shutdown()


def test_a_removed_adapter_nobody_needs_does_not_hold_the_only_seat(peft_model):
    # max_loras=1: the removed adapter's slot is kept only while requests of it may still run
    model = peft_model()
    prompt = _prompts([6], seed=11)[0]
    eng = Engine(model, max_loras=1)
    eng.generate([prompt], _params("chat"))
    assert set(eng.core.lora.slots.slot_of) == {"chat"}
    model.delete_adapter("chat")
    got = eng.generate([prompt], _params("math"))[0].output_token_ids
    assert got == peft_generate_alone(model, prompt, "math", 5)
    assert set(eng.core.lora.slots.slot_of) == {"math"}
    eng.shutdown()


def test_with_two_engines_on_a_model_too_many_live_adapters_are_refused(peft_model):
    # their schedulers do not see each other's waiting requests: admission keeps at most
    # max_loras adapters live over both, and refuses the rest (a batch whole)
    model = peft_model()
    prompts = _prompts([5, 6, 7], seed=4)
    first, second = Engine(model, max_loras=2), Engine(model)
    first.add_request(prompts[0], _params("math"))
    second.add_request(prompts[1], _params("chat"))
    with pytest.raises(ValueError, match=r"adapter: 3 distinct LoRA adapters.*max_loras \(2\)"):
        second.add_request(prompts[2], _params("code"))
    with pytest.raises(ValueError, match="max_loras"):
        first.generate(prompts, [_params(n) for n in ["math", "code", None]])
    second.shutdown()  # one Engine left: its scheduler queues what does not fit
    got = first.generate(prompts[1:], [_params("chat"), _params("code")])
    assert [o.output_token_ids for o in got] == [
        peft_generate_alone(model, prompts[1], "chat", 5),
        peft_generate_alone(model, prompts[2], "code", 5),
    ]
    first.check_invariants()
    first.shutdown()


def test_ranks_beyond_max_lora_rank_are_refused(peft_model, lora_b):
    from peft import LoraConfig

    model = peft_model()
    with pytest.raises(ValueError, match="max_lora_rank: 4 is less than the rank"):
        Engine(model, max_lora_rank=4)
    eng = Engine(model)  # None: the largest rank the model has (8)
    assert eng.config.max_lora_rank == 8
    model.add_adapter("wide", LoraConfig(r=16, target_modules=["q_proj"]))
    lora_b(model, "wide")
    with pytest.raises(ValueError, match=r"adapter: 'wide' has rank 16 .*max_lora_rank \(8\)"):
        eng.add_request([1, 2, 3], _params("wide"))
    assert not eng.has_unfinished_requests()
    eng.shutdown()


@pytest.mark.parametrize(
    ("option", "value"), [("max_loras", 0), ("max_loras", None), ("max_lora_rank", -1)]
)
def test_lora_options_are_validated(tiny_model, option, value):
    with pytest.raises(ValueError, match=f"{option} must be a positive integer"):
        Engine(tiny_model("llama"), **{option: value})


def test_a_removed_adapter_finishes_its_requests_and_frees_its_slot(peft_model):
    model = peft_model()
    prompt = _prompts([8], seed=9)[0]
    want = peft_generate_alone(model, prompt, "chat", 6)
    assert len(want) == 6  # no eos: the request is still running when the adapter goes
    eng = Engine(model, max_loras=2)
    running = eng.add_request(prompt, _params("chat", 6))
    outs = {}
    for _ in range(3):
        for o in eng.step():
            outs[o.request_id] = o.output_token_ids
    assert "chat" in eng.core.lora.slots.slot_of and eng.has_unfinished_requests()
    model.delete_adapter("chat")
    with pytest.raises(ValueError, match="adapter: unknown adapter 'chat'"):
        eng.add_request(prompt, _params("chat"))
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.output_token_ids
    assert outs[running] == want  # it ran to the end with the weights it started with
    eng.generate([prompt], _params("math"))  # the next step that resolves slots frees it
    assert set(eng.core.lora.slots.slot_of) == {"math"}
    eng.shutdown()


def test_a_removed_adapter_keeps_its_slot_for_waiting_requests(peft_model):
    # one seat: while another adapter's request runs, the removed adapter's waiting request
    # holds no row, yet its slot must stay (peft cannot give the weights again)
    model = peft_model()
    prompt = _prompts([8], seed=9)[0]
    want = peft_generate_alone(model, prompt, "chat", 6)
    eng = Engine(model, max_num_seqs=1, scheduling_policy="priority", max_loras=2)
    first = eng.add_request(prompt, _params("chat", 6))
    eng.step()
    waiting = eng.add_request(prompt, _params("chat", 6), priority=5)
    other = eng.add_request(prompt, _params("math", 6), priority=-1)  # before `waiting`
    eng.step()
    model.delete_adapter("chat")
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.output_token_ids
    assert outs[first] == outs[waiting] == want
    assert outs[other] == peft_generate_alone(model, prompt, "math", 6)
    eng.generate([prompt], _params("math"))  # nobody runs it any more: its slot is freed
    assert set(eng.core.lora.slots.slot_of) == {"math"}
    eng.shutdown()


def test_an_adapter_replaced_under_its_name_is_copied_again(peft_model, lora_b):
    from peft import LoraConfig

    model = peft_model()
    prompt = _prompts([10], seed=5)[0]
    eng = Engine(model)
    before = eng.generate([prompt], _params("code"))[0].output_token_ids
    assert before == peft_generate_alone(model, prompt, "code", 5)
    model.delete_adapter("code")
    model.add_adapter("code", LoraConfig(r=2, target_modules=["gate_proj", "v_proj"]))
    lora_b(model, "code")
    want = peft_generate_alone(model, prompt, "code", 5)
    assert want != before
    assert eng.generate([prompt], _params("code"))[0].output_token_ids == want
    eng.shutdown()


def test_an_adapter_loaded_later_may_target_any_projection(peft_model, lora_b):
    from peft import LoraConfig

    # q/v adapters only: k_proj and gate/up are plain Linear layers, which the engine fuses
    # (slices of one matrix); peft wraps the slices later as it wraps any Linear
    model = peft_model({"math": (8, ["q_proj", "v_proj"], False)})
    prompt = _prompts([7], seed=7)[0]
    eng = Engine(model)
    assert eng.num_fused_projections == 4  # q/k/v and gate/up of both layers
    model.add_adapter("mlp", LoraConfig(r=5, target_modules=["gate_proj", "up_proj", "k_proj"]))
    lora_b(model, "mlp")
    got = eng.generate([prompt, prompt], [_params("mlp"), _params("math")])
    assert [o.output_token_ids for o in got] == [
        peft_generate_alone(model, prompt, "mlp", 5),
        peft_generate_alone(model, prompt, "math", 5),
    ]
    eng.shutdown()
    # unfused: every LoRA layer (those peft added while fused too) wraps a plain Linear again
    bases = [m.base_layer for m in model.modules() if hasattr(m, "lora_A")]
    assert len(bases) == 10 and all(type(b) is torch.nn.Linear for b in bases)


@pytest.mark.parametrize("folded", [False, True])
def test_compiled_lora_path_matches_eager_with_one_graph(peft_model, monkeypatch, folded):
    import torch._dynamo

    fold_lora_shrinks(monkeypatch, folded)
    model = peft_model()
    prompts = _prompts([3, 17, 9, 30], seed=6)
    names = ["math", "chat", None, "code"]
    params = [_params(n, 4) for n in names]
    opts = dict(attention_backend="torch", max_num_batched_tokens=32)
    eager = Engine(model, compile=False, **opts)
    want = [o.output_token_ids for o in eager.generate(prompts, params)]
    eager.shutdown()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eng = Engine(model, compile=True, **opts)
    assert eng.config.compile  # LoRA no longer turns compile off
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    assert got == want
    assert eng.runner.forward.compiled  # no fallback to eager
    # every decoder layer shares one graph; steps with and without adapters share it too
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    eng.shutdown()


def test_engines_on_one_model_share_its_slots(peft_model):
    model = peft_model()
    prompt = _prompts([6], seed=10)[0]
    first = Engine(model, max_loras=2)
    second = Engine(model, max_loras=5)  # the slots exist already: the first Engine's options
    assert second.config.max_loras == 2 and second.core.lora is first.core.lora
    for eng, name in ((first, "math"), (second, "code"), (second, None), (first, "chat")):
        assert eng.generate([prompt], _params(name))[0].output_token_ids == peft_generate_alone(
            model, prompt, name, 5
        )
    first.shutdown()
    assert second.generate([prompt], _params("math"))[0].output_token_ids == peft_generate_alone(
        model, prompt, "math", 5
    )
    second.shutdown()
    assert not any("hf_paged" in n for n, _ in model.named_buffers())


def test_the_slot_buffers_leave_with_the_engine(peft_model):
    model = peft_model()
    names = {n for n, _ in model.named_buffers()}
    eng = Engine(model)
    assert any("hf_paged_lora_a" in n for n, _ in model.named_buffers())
    assert not any("hf_paged" in k for k in model.state_dict())  # never saved with the model
    eng.shutdown()
    assert {n for n, _ in model.named_buffers()} == names
