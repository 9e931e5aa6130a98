"""Asynchronous scheduling (Engine(async_scheduling=True)): step n+1 is scheduled and launched
before step n's tokens reach the host, decode inputs are read on the device, stop checks run one
step late. It must change no output: every test compares against the synchronous engine (or
transformers) on the same model, under chunked prefill, preemption, prefix hits, stops, aborts,
seeded sampling and requests that force synchronous steps."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import Engine, SamplingParams
from hf_paged.worker.async_output import PendingOutput


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def count_async_launches(monkeypatch):
    """Counts steps launched with async_output (runs ahead of the host)."""
    calls = {"n": 0}
    init = PendingOutput.__init__

    def counting(self, *a, **k):
        calls["n"] += 1
        init(self, *a, **k)

    monkeypatch.setattr(PendingOutput, "__init__", counting)
    return calls


def _run(model, prompts, params, **opts):
    opts.setdefault("async_scheduling", False)  # the reference is the synchronous engine
    eng = Engine(model, attention_backend="torch", **opts)
    outs = eng.generate(prompts, params)
    eng.check_invariants()
    return [(o.output_token_ids, o.finish_reason) for o in outs], eng


OPTION_SETS = [
    pytest.param({"block_size": 16}, id="plain"),
    pytest.param({"block_size": 16, "max_num_batched_tokens": 32}, id="chunked"),
    pytest.param({"block_size": 8, "num_blocks": 24}, id="preemption"),
    pytest.param({"block_size": 16, "max_num_seqs": 3}, id="few-seats"),
]


@pytest.mark.parametrize("opts", OPTION_SETS)
def test_async_greedy_equals_sync(tiny_model, opts, count_async_launches):
    model = tiny_model("llama")
    prompts = _prompts([1, 40, 60, 7, 80, 33, 20])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 30, 1, 17)]
    params = [params[i % len(params)] for i in range(len(prompts))]
    sync, _ = _run(model, prompts, params, **opts)
    got, eng = _run(model, prompts, params, async_scheduling=True, **opts)
    assert got == sync
    assert count_async_launches["n"] > 0
    if "num_blocks" in opts:
        assert eng.stats()["num_preemptions"] > 0


def test_async_stops_on_stop_tokens_one_step_late_without_extra_tokens(tiny_model):
    model = tiny_model("llama")
    prompts = _prompts([12, 50, 5, 70], seed=3)
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first, _ = _run(model, prompts, free)
    # stop on tokens each request generates mid-way: the async engine learns of the stop a step
    # late and must drop the extra token it computed
    stops = sorted({toks[len(toks) // 2] for toks, _ in first})
    params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=stops)
    sync, _ = _run(model, prompts, params)
    got, _ = _run(model, prompts, params, async_scheduling=True)
    assert got == sync
    assert any(reason == "stop" for _, reason in got)


def test_async_prefix_cache_hits_and_hashes_only_known_tokens(tiny_model):
    model = tiny_model("llama")
    base = _prompts([64], seed=4)[0]
    prompts = [base, base + [5, 6, 7], base]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        eng = Engine(
            model, attention_backend="torch", block_size=8, async_scheduling=async_scheduling
        )
        first = eng.generate(prompts, params)
        # a continuation of a finished request (prompt + its outputs) hits the blocks written
        # during decode: a block hashed while it held a not-yet-known token would not be found
        cont = eng.generate([base + first[0].output_token_ids[:32]], params)[0]
        eng.check_invariants()
        results.append(
            (
                [o.output_token_ids for o in first],
                [o.num_cached_tokens for o in first],
                cont.output_token_ids,
                cont.num_cached_tokens,
            )
        )
    assert results[1] == results[0]
    assert results[1][3] >= 88  # 96 known tokens: all full blocks but the last are hits


def test_async_seeded_sampling_equals_sync(tiny_model):
    model = tiny_model("llama")
    prompts = _prompts([10, 30, 3], seed=5)
    params = [
        SamplingParams(max_tokens=25, temperature=1.1, top_k=50, top_p=0.9, seed=s, ignore_eos=True)
        for s in (1, 2, 3)
    ]
    sync, _ = _run(model, prompts, params)
    got, _ = _run(model, prompts, params, async_scheduling=True)
    assert got == sync


@pytest.mark.parametrize("opts", [OPTION_SETS[0], OPTION_SETS[2]])
def test_async_penalties_equal_sync(tiny_model, opts, count_async_launches):
    """Penalised requests run ahead of the host: the token still in flight is counted from the
    device (read before the forward, which overwrites last_tokens in a decode graph), the host's
    copy of it later is not counted twice; greedy and seeded sampling rows, every penalty."""
    model = tiny_model("llama")
    prompts = _prompts([12, 40, 5, 27], seed=8)
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=4, ignore_eos=True,
                       presence_penalty=0.8, frequency_penalty=0.5),
        SamplingParams(max_tokens=18, temperature=0, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(max_tokens=26, temperature=1.0, top_p=0.9, seed=9, ignore_eos=True,
                       repetition_penalty=1.2, presence_penalty=0.3),
    ]  # fmt: skip
    sync, _ = _run(model, prompts, params, **opts)
    count_async_launches["n"] = 0
    got, eng = _run(model, prompts, params, async_scheduling=True, **opts)
    assert got == sync
    assert count_async_launches["n"] >= 24  # every decode step ran ahead
    assert not eng.runner.input_batch.penalty_counts.slot_of  # every pool row released


def test_requests_that_read_history_force_sync_steps(tiny_model, count_async_launches):
    model = tiny_model("llama")
    prompts = _prompts([20, 35, 8], seed=6)
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, no_repeat_ngram_size=2),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
    ]
    sync, _ = _run(model, prompts, params)
    got, eng = _run(model, prompts, params, async_scheduling=True)
    assert got == sync
    # once the history-reading requests finish, the rest runs ahead again
    assert count_async_launches["n"] > 0
    # n > 1 forks too
    fork = SamplingParams(max_tokens=6, temperature=0.8, n=3, seed=7, ignore_eos=True)
    assert [o.output_token_ids for o in eng.generate([prompts[0]], fork)] == [
        o.output_token_ids
        for o in Engine(model, attention_backend="torch").generate([prompts[0]], fork)
    ]
    eng.check_invariants()


def test_abort_while_a_step_is_in_flight(tiny_model):
    model = tiny_model("llama")
    prompts = _prompts([15, 25, 35], seed=8)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    sync, _ = _run(model, prompts, params)
    eng = Engine(model, attention_backend="torch", async_scheduling=True)
    ids = [eng.add_request(p, params) for p in prompts]
    tokens = {rid: [] for rid in ids}
    for _ in range(6):
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    assert eng.core._inflight is not None  # a step is launched and unread
    eng.abort(ids[1])
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens[ids[0]] == sync[0][0]
    assert tokens[ids[2]] == sync[2][0]
    assert tokens[ids[1]] == sync[1][0][: len(tokens[ids[1]])]
    eng.check_invariants()


def test_patched_generate_with_async_scheduling_matches_transformers(tiny_model, batch_factory):
    model = tiny_model("qwen2")
    ids, mask = batch_factory([1, 30, 64, 9, 120], seed=9)
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=32)
    hf_paged.patch(model, async_scheduling=True, max_num_batched_tokens=64)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=32)
        hf_paged.get_engine(model).check_invariants()
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)


def test_async_scheduling_option_is_validated(tiny_model):
    with pytest.raises(ValueError, match="async_scheduling"):
        Engine(tiny_model("llama"), async_scheduling="yes")


def test_defaults_run_ahead_and_step_reports_one_call_late(tiny_model):
    eng = Engine(tiny_model("llama"), attention_backend="torch")
    assert eng.config.async_scheduling and eng.config.fuse_projections
    assert eng.config.compile_scope == "layers"
    rid = eng.add_request(_prompts([12])[0], SamplingParams(max_tokens=4, temperature=0))
    assert eng.step() == []  # the prefill is launched; its token is read on the next call
    got = []
    while eng.has_unfinished_requests():
        got += [t for out in eng.step() for t in out.new_token_ids]
    params = SamplingParams(max_tokens=4, temperature=0)
    sync, _ = _run(tiny_model("llama"), [_prompts([12])[0]], params)
    assert got == sync[0][0] and rid
    eng.check_invariants()
