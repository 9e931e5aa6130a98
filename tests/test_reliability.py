"""A patched model stays usable and exact whatever happens to the requests in it: beams end and
give back everything, an exception in user code fails only its own request, threads share one
engine, another Engine's shutdown does not unpatch a live one, and bad input is refused at the
door. Each test here failed before the engine had one exit for requests (Scheduler.end_requests),
a lock, a model lease and strict validation."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LogitsProcessor, StoppingCriteria

import hf_paged
from hf_paged import Engine, SamplingParams


class Boom(RuntimeError):
    """The user's own exception: it must reach the caller as it is."""


class RaiseAtLength(StoppingCriteria):
    """A user stopping criterion that raises once the sequence reaches `length` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[-1] >= self.length:
            raise Boom(f"criterion raised at {input_ids.shape[-1]} tokens")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class RaiseAtLengthProcessor(LogitsProcessor):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] >= self.length:
            raise Boom(f"processor raised at {input_ids.shape[-1]} tokens")
        return scores


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _reference(model, ids, mask=None, **kwargs):
    """transformers' own generate on a model that was never patched."""
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


def _nothing_held(engine: Engine) -> None:
    engine.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv.get_num_free_blocks() == engine.kv.num_blocks
    assert not engine.runner.input_batch.req_to_row
    assert len(engine.runner.input_batch.free_rows) == engine.config.max_num_seqs


# -- 1. beam search gives back its rows -----------------------------------------------------------


def test_beam_search_releases_rows_small_max_num_seqs(tiny_model, batch_factory):
    model, ref = tiny_model("llama"), tiny_model("llama")
    hf_paged.patch(model, max_num_seqs=4)
    ids, mask = batch_factory([5])
    want = _reference(ref, ids, mask, num_beams=2, max_new_tokens=4)
    for _ in range(6):  # the third call raised "more running requests than max_num_seqs rows"
        got = model.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=4)
        assert torch.equal(got, want)
        _nothing_held(hf_paged.get_engine(model))
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(greedy, _reference(ref, ids, mask, max_new_tokens=6))


def test_hundred_beam_calls_then_greedy_match_transformers(
    tiny_model, one_torch_thread, batch_factory
):
    """With the defaults, batch 4 x 4 beams failed on the 17th call."""
    model, ref = tiny_model("llama"), tiny_model("llama")
    hf_paged.patch(model)
    engine = hf_paged.get_engine(model)
    batches = [batch_factory([6, 4, 7, 5], seed=s) for s in range(3)]
    wants = [_reference(ref, i, m, num_beams=4, max_new_tokens=3) for i, m in batches]
    for call in range(100):
        ids, mask = batches[call % 3]
        got = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=3)
        assert torch.equal(got, wants[call % 3]), call
        assert not engine.runner.input_batch.req_to_row
        assert engine.kv.get_num_free_blocks() == engine.kv.num_blocks
    ids, mask = batches[0]
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(greedy, _reference(ref, ids, mask, max_new_tokens=8))
    _nothing_held(engine)


# -- 2. an exception in user code fails its own request only --------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("where", ["criterion", "processor"])
def test_user_code_exception_fails_only_its_request(tiny_model, where, async_scheduling):
    engine = Engine(tiny_model("llama"), async_scheduling=async_scheduling)
    prompt = _prompt(6)
    if where == "criterion":  # raises on the step where `short` finishes
        bad = SamplingParams(max_tokens=10, temperature=0, stopping_criteria=[RaiseAtLength(8)])
    else:
        bad = SamplingParams(
            max_tokens=10, temperature=0, logits_processors=[RaiseAtLengthProcessor(8)]
        )
    short = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0))
    failing = engine.add_request(prompt, bad)
    long = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, "two final outputs"
                final[out.request_id] = out
        engine.check_invariants()
    assert final[short].finish_reason == "length" and len(final[short].output_token_ids) == 2
    assert final[long].finish_reason == "length" and len(final[long].output_token_ids) == 12
    err = final[failing]
    assert err.finish_reason == "error" and isinstance(err.error, Boom)
    # 8 tokens: the criterion sees them once the second token is in; the processor sees them
    # when choosing the third, which is void
    assert len(err.output_token_ids) == 2
    assert err.output_token_ids == final[long].output_token_ids[: len(err.output_token_ids)]
    with pytest.raises(ValueError, match=r"^request_id '.*' is not a running or waiting request$"):
        engine.abort(failing)  # not a ghost: gone, with a short message
    _nothing_held(engine)
    # and the engine runs on
    again = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    assert again[0].output_token_ids == final[long].output_token_ids


@pytest.mark.parametrize("where", ["criterion", "processor"])
def test_generate_reraises_the_user_exception_and_stays_usable(tiny_model, batch_factory, where):
    model, ref = tiny_model("llama"), tiny_model("llama")
    hf_paged.patch(model)
    ids, mask = batch_factory([5, 7])
    kwargs = (
        dict(stopping_criteria=[RaiseAtLength(10)])
        if where == "criterion"
        else dict(logits_processor=[RaiseAtLengthProcessor(10)])
    )
    with pytest.raises(Boom):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **kwargs)
    _nothing_held(hf_paged.get_engine(model))
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(got, _reference(ref, ids, mask, max_new_tokens=8))


def test_beam_user_criterion_exception_reaches_the_caller(tiny_model, batch_factory):
    model = tiny_model("llama")
    hf_paged.patch(model)
    ids, mask = batch_factory([5])
    with pytest.raises(Boom):
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            num_beams=2,
            max_new_tokens=6,
            stopping_criteria=[RaiseAtLength(8)],
        )
    _nothing_held(hf_paged.get_engine(model))


# -- 3. threads -----------------------------------------------------------------------------------


def test_generate_from_eight_threads_matches_one_thread(
    tiny_model, one_torch_thread, batch_factory
):
    model = tiny_model("llama")
    hf_paged.patch(model)
    engine = hf_paged.get_engine(model)
    inputs = [batch_factory([4 + s % 5, 3 + s % 3], seed=s) for s in range(8)]
    kinds = [dict(max_new_tokens=6), dict(max_new_tokens=4, num_beams=2)]
    want = {
        (i, k): model.generate(input_ids=ids, attention_mask=m, **kinds[k])
        for i, (ids, m) in enumerate(inputs)
        for k in range(2)
    }
    errors: list[BaseException] = []
    mismatches: list[tuple] = []

    def worker(t: int) -> None:
        try:
            for call in range(25):
                i, k = (t + call) % 8, (call % 5 == 4)  # every fifth call is beam search
                ids, m = inputs[i]
                got = model.generate(input_ids=ids, attention_mask=m, **kinds[k])
                if not torch.equal(got, want[(i, k)]):
                    mismatches.append((t, call))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert not mismatches, mismatches[:5]
    _nothing_held(engine)


def test_engine_stepped_by_one_thread_while_another_adds_and_aborts(tiny_model, one_torch_thread):
    engine = Engine(tiny_model("llama"), max_num_seqs=4, block_size=4, num_blocks=24)
    prompts = [_prompt(3 + s % 9, s) for s in range(40)]
    params = SamplingParams(max_tokens=6, temperature=0)
    want = [o.output_token_ids for o in engine.generate(prompts, params)]
    added: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    final: dict[str, object] = {}

    def stepper() -> None:
        try:
            while not stop.is_set() or engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=stepper)
    th.start()
    try:
        for i, p in enumerate(prompts):
            added.append(engine.add_request(p, params, request_id=f"r{i}"))
            if i % 3 == 2:
                try:
                    engine.abort(added[i - 1])
                except ValueError:  # it finished first: fine
                    pass
    finally:
        stop.set()
        th.join()
    assert not errors, errors[:3]
    assert set(final) == set(added)  # every request, aborted or not, has a final output
    for i, rid in enumerate(added):
        out = final[rid]
        if out.finish_reason == "abort":
            assert out.output_token_ids == want[i][: len(out.output_token_ids)]
        else:
            assert out.output_token_ids == want[i], rid
    _nothing_held(engine)


# -- 4. an Engine holds its model -----------------------------------------------------------------


def test_unpatch_leaves_other_engines_on_the_model_working(tiny_model):
    model, ref = tiny_model("llama"), tiny_model("llama")
    ids = torch.tensor([_prompt(7)])
    want = _reference(ref, ids, max_new_tokens=8)[0, 7:].tolist()
    params = SamplingParams(max_tokens=8, temperature=0)
    engine = Engine(model)
    hf_paged.patch(model)
    hf_paged.unpatch(model)  # used to put sdpa back under `engine`: garbage, no error
    assert model.config._attn_implementation == "hf_paged"
    assert engine.generate([ids[0].tolist()], params)[0].output_token_ids == want
    pipe_model = tiny_model("llama")
    hf_paged.patch(pipe_model)
    other = Engine(pipe_model)
    hf_paged.unpatch(pipe_model)
    assert other.generate([ids[0].tolist()], params)[0].output_token_ids == want
    other.shutdown()
    assert pipe_model.config._attn_implementation != "hf_paged"  # the last one out restores
    engine.shutdown()
    assert model.config._attn_implementation != "hf_paged"
    assert torch.equal(
        model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[0, 7:], torch.tensor(want)
    )


def test_switching_attention_under_a_live_engine_fails_loudly(tiny_model):
    model = tiny_model("llama")
    engine = Engine(model)
    engine.add_request(_prompt(5), SamplingParams(max_tokens=4))
    model.set_attn_implementation("sdpa")
    with pytest.raises(
        RuntimeError, match="attention switched to 'sdpa' while this Engine is live"
    ):
        engine.step()
    model.set_attn_implementation("hf_paged")
    while engine.has_unfinished_requests():
        engine.step()


def test_step_after_shutdown_raises_a_clear_error(tiny_model):
    engine = Engine(tiny_model("llama"))
    engine.shutdown()
    for call in (engine.step, lambda: engine.add_request([5, 6], SamplingParams())):
        with pytest.raises(RuntimeError, match="Engine: shut down"):
            call()
    engine.shutdown()  # twice is harmless


def test_failed_construction_gives_the_model_back(tiny_model):
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model, max_model_len=10**6)
    assert model.config._attn_implementation == before
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # not left fused


# -- 5. strict validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(block_size=True), "block_size"),
        (dict(num_blocks=2.0), "num_blocks"),
        (dict(max_num_seqs=False), "max_num_seqs"),
        (dict(block_size=7, attention_backend="triton"), "block_size"),
        (dict(kv_cache_dtype="float8_e4m3fn"), "kv_cache_dtype"),
        (dict(max_model_len=100_000), "max_model_len"),
        (dict(gpu_memory_utilization=True), "gpu_memory_utilization"),
    ],
)
def test_bad_engine_options_are_refused_at_construction(tiny_model, options, field):
    with pytest.raises(ValueError, match=field):
        Engine(tiny_model("llama"), **options)


def test_bad_requests_are_refused_and_change_nothing(tiny_model):
    engine = Engine(tiny_model("llama"))
    keep = engine.add_request(_prompt(5), SamplingParams(max_tokens=40, temperature=0))
    bad = [
        (lambda: engine.add_request([1.5, 2.0]), "integers"),
        (lambda: engine.add_request([True, 4]), "integers"),
        (lambda: engine.add_request(torch.tensor([1.0, 2.0])), "integer token ids"),
        (lambda: engine.add_request(torch.tensor([[3, 4]])), "1-D"),
        (lambda: engine.add_request([3, 4], request_id=7), "request_id must be a str"),
        (lambda: engine.add_request([3, 4], priority=1.5), "priority"),
        (lambda: engine.abort(7), "request_id must be a str"),
        (lambda: engine.abort("nope"), "request_id 'nope'"),
        (lambda: engine.generate("a string"), "prompts must be a list"),
    ]
    for call, field in bad:
        with pytest.raises(ValueError, match=field):
            call()
        engine.check_invariants()
    outs = engine.generate([_prompt(4)], SamplingParams(max_tokens=3, temperature=0))
    assert len(outs[0].output_token_ids) == 3
    assert set(engine.scheduler.requests) == {keep}  # nothing the refused calls tried got in
    final = []
    while engine.has_unfinished_requests():
        final += [out for out in engine.step() if out.finished]
    assert [(o.request_id, len(o.output_token_ids)) for o in final] == [(keep, 40)]
    _nothing_held(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(repetition_penalty=0.0), "`penalty` has to be a strictly positive float"),
        (dict(num_beams=0), "num_beams must be a positive integer"),
        (dict(num_return_sequences=0), "num_return_sequences must be a positive integer"),
        (dict(float_ids=True), "input_ids must hold integer token ids"),
        (dict(one_dim=True), r"input_ids must be \[batch, length\]"),
    ],
)
def test_generate_refuses_what_transformers_refuses(tiny_model, batch_factory, kwargs, message):
    model, ref = tiny_model("llama"), tiny_model("llama")
    hf_paged.patch(model)
    ids, mask = batch_factory([5, 4])
    if kwargs.pop("float_ids", False):
        ids = ids.float()
    if kwargs.pop("one_dim", False):
        ids, mask = ids[0], None
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, **kwargs)
    ids, mask = batch_factory([5, 4])
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
    assert torch.equal(got, _reference(ref, ids, mask, max_new_tokens=3))
    _nothing_held(hf_paged.get_engine(model))


# -- 6. aborts report -----------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_gives_a_final_output_for_the_request_and_its_unstarted_siblings(
    tiny_model, async_scheduling
):
    engine = Engine(tiny_model("llama"), async_scheduling=async_scheduling)
    rid = engine.add_request(_prompt(6), SamplingParams(max_tokens=8, n=3, temperature=0))
    engine.abort(rid)  # before its prompt ran: the siblings never started
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason, o.finished) for o in outs) == [
        (rid, "abort", True),
        (f"{rid}#1", "abort", True),
        (f"{rid}#2", "abort", True),
    ]
    assert not engine.has_unfinished_requests() and engine.step() == []
    _nothing_held(engine)
