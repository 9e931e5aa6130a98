"""Structured output under asynchronous scheduling: a constrained step's sampling is deferred
until the step loop has handled the previous step's output and prepared the next step, so the
grammar's host work (accepting the last tokens, filling the bitmask) overlaps the forward
(ModelRunner._defer_sampling). The tokens must equal the synchronous engine's."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from hf_paged import SamplingParams
from hf_paged.engine.core import EngineCore
from hf_paged.structured_output.batch_calls import BatchCalls
from hf_paged.structured_output.logits_mask import GrammarBitmask, RowMatcher, fill_threads
from hf_paged.worker.model_runner import ModelRunner

pytest.importorskip("xgrammar")
so = pytest.importorskip("tests.test_structured_output")


@pytest.fixture(scope="module")
def tok():
    return so.json_tokenizer()


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama")


def mixed_batch():
    prompts = ["one", "two", "three", "four", "five", "six"]
    params = [
        so.constrained(json=so.SCHEMA, temperature=0, max_tokens=60),
        SamplingParams(max_tokens=12, temperature=0),
        so.constrained(regex=r"[a-f]{3}-\d{2}", temperature=0),
        so.constrained(json=so.SCHEMA, temperature=0.8, seed=7, max_tokens=60),
        SamplingParams(max_tokens=9, temperature=0.9, seed=3),
        so.constrained(choice=["red", "green", "blue"], seed=11),
    ]
    return prompts, params


def run(model, tok, async_scheduling, **options):
    eng = so.make_engine(model, tok, async_scheduling=async_scheduling, **options)
    prompts, params = mixed_batch()
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    finals = so._run_to_end(eng)  # checks the invariants after every step
    eng.check_invariants()
    outs = [finals[i] for i in ids]
    eng.shutdown()
    return [o.output_token_ids for o in outs], [o.finish_reason for o in outs]


def test_deferred_sampling_gives_the_synchronous_tokens(model, tok, monkeypatch):
    import threading

    order = []  # what the step loop did, in order
    helper_runs = []  # the threads that ran the xgrammar calls of a started job
    real_start = GrammarBitmask.start
    real_run = GrammarBitmask.run
    real_resolve = EngineCore._resolve_inflight
    real_release = ModelRunner.release
    released_while_deferred = []

    def start(self, *args):
        order.append("start")
        return real_start(self, *args)

    def run_job(self, job, *part):
        helper_runs.append(threading.current_thread() is threading.main_thread())
        return real_run(self, job, *part)

    def resolve(self):
        order.append("resolve")
        return real_resolve(self)

    def release(self, req_ids):
        pending = self._pending
        if pending is not None and pending.deferred is not None:
            rows = {self.input_batch.req_to_row.get(r) for r in req_ids}
            released_while_deferred.extend(rows & set(pending.rows.tolist()))
        return real_release(self, req_ids)

    monkeypatch.setattr(GrammarBitmask, "start", start)
    monkeypatch.setattr(GrammarBitmask, "run", run_job)
    monkeypatch.setattr(EngineCore, "_resolve_inflight", resolve)
    monkeypatch.setattr(ModelRunner, "release", release)
    interval = sys.getswitchinterval()
    sync = run(model, tok, async_scheduling=False)
    assert "start" not in order and all(helper_runs)  # the synchronous engine: in line
    order.clear()
    helper_runs.clear()
    overlapped = run(model, tok, async_scheduling=True)
    assert overlapped == sync
    # a deferred step's grammar work starts as the previous step's tokens land, inside the
    # step loop's handling of that step's output, and runs on the helper thread
    assert order.count("start") >= 5
    assert ("resolve", "start") in zip(order, order[1:])
    assert helper_runs.count(False) >= 5
    assert sys.getswitchinterval() == interval  # put back once the jobs were taken
    # requests ended and their rows were released while a step that samples them waited
    assert released_while_deferred


def test_preempted_rows_replay_under_the_overlap(model, tok):
    """Few blocks: rows are rebuilt after preemption while the helper works; the rebuilt
    row's matcher replays its history, and the tokens equal the synchronous engine's."""
    small = dict(num_blocks=16, block_size=8, enable_prefix_caching=True)
    sync = run(model, tok, async_scheduling=False, **small)
    assert run(model, tok, async_scheduling=True, **small) == sync


class Row:
    """The fields of a SamplingRow that the grammar's hook reads."""

    def __init__(self, req_id, structured, token_ids, num_prompt_tokens=2):
        self.req_id, self.structured = req_id, structured
        self.token_ids, self.num_prompt_tokens = token_ids, num_prompt_tokens


def test_gather_run_finish(tok):
    from hf_paged.structured_output.compiler import GrammarService
    from hf_paged.structured_output.constraint import StructuredOutputs

    service = GrammarService(tok, len(tok))
    compiled = service.submit(StructuredOutputs(regex="[ab]{2}")).compiled
    service.shutdown()
    a, b, bad = tok.convert_tokens_to_ids(["a", "b", "{"])
    eos = tok.eos_token_id
    assert bad != tok.unk_token_id
    grammar = GrammarBitmask(torch.device("cpu"))
    states = [RowMatcher(compiled, {eos}) for _ in range(4)]
    assert states[0].unseen([5, 6, a, b], 2) == [a, b]
    # one new token a row: one batched accept; a refused token leaves its matcher before it,
    # its request fails alone; an unconstrained row is skipped
    rows = [
        Row("r0", states[0], [5, 6, a]),
        Row("plain", None, [5, 6, a]),
        Row("r1", states[1], [5, 6, b]),
        Row("r2", states[2], [5, 6, bad]),
        Row("r3", states[3], [5, 6]),  # no output yet: nothing to accept, filled
    ]
    mask = grammar.prepare(rows, len(tok))
    assert [s.num_accepted for s in states] == [1, 1, 0, 0]
    assert mask.sel == [0, 2, 4] and set(mask.failed) == {"r2"}
    assert "not allowed" in str(mask.failed["r2"])
    allowed = allowed_ids(mask.bitmask[0], len(tok))
    assert a in allowed and b in allowed and eos not in allowed  # one more letter, then end
    # rows replaying several tokens (rebuilt after preemption) accept them one by one; a row
    # whose token is its stop token ends (it is not filled: xgrammar refuses that) on both paths
    rows = [
        Row("r0", states[0], [5, 6, a, b]),
        Row("r1", states[1], [5, 6, b, a, eos]),  # replays a and the stop token
        Row("r3", states[3], [5, 6, a, bad, b]),  # replays a, then a refused token
    ]
    mask = grammar.prepare(rows, len(tok))
    assert [s.num_accepted for s in states] == [2, 3, 0, 1]
    assert states[1].matcher.is_terminated()
    assert mask.sel == [0] and set(mask.failed) == {"r3"}
    assert allowed_ids(mask.bitmask[0], len(tok)) == [eos]  # complete: only its end
    mask = grammar.prepare([Row("r0", states[0], [5, 6, a, b, eos])], len(tok))
    assert mask.bitmask is None and mask.sel == [] and not mask.failed
    assert states[0].matcher.is_terminated() and states[0].num_accepted == 3


def test_greedy_rows_argmax_kernel_equals_mask_then_argmax(tok):
    """The sampler's all-greedy path on a GPU (GrammarBitmask.argmax_kernel: the argmax kernel
    reading the bitmask; here under the interpreter) gives the CPU path's tokens (the mask
    written into the logits, then argmax), with unconstrained rows in the batch, and with none."""
    from hf_paged.structured_output.compiler import GrammarService
    from hf_paged.structured_output.constraint import StructuredOutputs

    service = GrammarService(tok, len(tok))
    compiled = service.submit(StructuredOutputs(regex="[ab]{2}c")).compiled
    service.shutdown()
    a = tok.convert_tokens_to_ids("a")
    grammar = GrammarBitmask(torch.device("cpu"))
    rows = [
        Row("r0", RowMatcher(compiled, {tok.eos_token_id}), [5, 6, a]),
        Row("plain", None, [5, 6, a]),
        Row("r1", RowMatcher(compiled, {tok.eos_token_id}), [5, 6]),
    ]
    mask = grammar.prepare(rows, len(tok))
    assert mask.sel == [0, 2]
    logits = torch.randn(3, len(tok), generator=torch.Generator().manual_seed(0))
    want = grammar.argmax(logits.clone(), mask)
    assert want[1] == logits[1].argmax()  # the plain row: its own argmax
    assert want[0] != logits[0].argmax() and want[2] != logits[2].argmax()  # masked rows
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter on the CPU)
    assert torch.equal(grammar.argmax_kernel(logits.to(device), mask).cpu(), want)
    every = grammar.prepare([rows[0], rows[2]], len(tok))
    assert every.sel == [0, 1]
    two = logits[[0, 2]]
    assert torch.equal(
        grammar.argmax_kernel(two.to(device), every).cpu(), grammar.argmax(two.clone(), every)
    )


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = bitmask_row.tolist()
    return [t for t in range(vocab) if (bits[t // 32] >> (t % 32)) & 1]


def test_helper_equals_in_line(tok):
    """The job run on the helper thread gives the in-line prepare()'s rows, failures, bitmask
    and matcher states, over rows of every kind: unconstrained, one new token, none yet, a
    replayed history, a refused token, a stop token."""
    from hf_paged.structured_output.compiler import GrammarService
    from hf_paged.structured_output.constraint import StructuredOutputs

    service = GrammarService(tok, len(tok))
    compiled = service.submit(StructuredOutputs(regex="[ab]{2}c?")).compiled
    service.shutdown()
    a, b, c, bad = tok.convert_tokens_to_ids(["a", "b", "c", "{"])
    eos = tok.eos_token_id
    histories = [[a], None, [b], [bad], [], [a, b], [a, b, eos], [b], [a, bad], [a], None, [b]]

    def rows_of(states):
        return [
            Row(f"r{i}", None if h is None else states[i], [5, 6, *(h or [])])
            for i, h in enumerate(histories)
        ]

    def fresh():
        states = [RowMatcher(compiled, {eos}) for _ in histories]
        for state, h in zip(states, histories):  # rows past their first token: one new each
            if h and len(h) == 2:
                assert state.accept(h[:1]) is None
        return states

    in_line, helper = GrammarBitmask(torch.device("cpu")), GrammarBitmask(torch.device("cpu"))
    try:
        s1, s2 = fresh(), fresh()
        want = in_line.prepare(rows_of(s1), len(tok))
        want_bits = want.bitmask[want.sel].clone()
        got = helper.start(rows_of(s2), len(tok)).result()
        assert helper._helper is not None and in_line._helper is None
        assert got.sel == want.sel and set(got.failed) == set(want.failed) == {"r3", "r8"}
        assert torch.equal(got.bitmask[got.sel], want_bits)
        assert [s.num_accepted for s in s2] == [s.num_accepted for s in s1]
        assert [s.matcher.is_terminated() for s in s2] == [s.matcher.is_terminated() for s in s1]
    finally:
        in_line.close()
        helper.close()


def test_helper_job_switch_interval_and_errors(tok, monkeypatch):
    """start() runs the xgrammar calls on the helper thread with the GIL switch interval
    lowered while any job (of any engine) runs, put back as the last one ends, whether or not
    its mask is ever taken; an error there reaches the caller of result()."""
    import threading

    from hf_paged.structured_output.compiler import GrammarService
    from hf_paged.structured_output.constraint import StructuredOutputs

    service = GrammarService(tok, len(tok))
    compiled = service.submit(StructuredOutputs(regex="[ab]{3}")).compiled
    service.shutdown()
    a = tok.convert_tokens_to_ids("a")
    eos = {tok.eos_token_id}
    gates = {}  # request id -> the event its job waits for on the helper
    real_run = GrammarBitmask.run

    def gated_run(self, job):
        gates[job.req_ids[0]].wait(timeout=30)
        return real_run(self, job)

    monkeypatch.setattr(GrammarBitmask, "run", gated_run)
    interval = sys.getswitchinterval()
    one, two = GrammarBitmask(torch.device("cpu")), GrammarBitmask(torch.device("cpu"))
    try:
        gates["x"], gates["y"] = threading.Event(), threading.Event()
        first = one.start([Row("x", RowMatcher(compiled, eos), [5, 6, a])], len(tok))
        second = two.start([Row("y", RowMatcher(compiled, eos), [5, 6, a])], len(tok))
        assert sys.getswitchinterval() < interval
        gates["x"].set()
        assert first.result().sel == [0]  # the first ended: the second still runs
        assert sys.getswitchinterval() < interval
        gates["y"].set()
        two.close()  # its job ends; its mask is never taken
        assert sys.getswitchinterval() == interval
        assert second.result().sel == [0]
        assert one.start([Row("z", None, [5, 6, a])], len(tok)).result().bitmask is None

        def refuse(*args):
            raise RuntimeError("xgrammar refused the call")

        monkeypatch.setattr(BatchCalls, "fill", refuse)  # raised on the helper thread
        gates["w"] = threading.Event()
        gates["w"].set()
        failing = one.start([Row("w", RowMatcher(compiled, eos), [5, 6, a])], len(tok))
        with pytest.raises(RuntimeError, match="xgrammar refused the call"):
            failing.result()
        one.close()
        assert sys.getswitchinterval() == interval
    finally:
        for gate in gates.values():
            gate.set()
        one.close()
        two.close()
        sys.setswitchinterval(interval)


def test_an_idle_engine_leaves_the_switch_interval_alone(model, tok):
    """generate() returns with the last step's sampling still deferred (its requests ended):
    the helper's job for it has ended, and the interval is back."""
    interval = sys.getswitchinterval()
    eng = so.make_engine(model, tok, async_scheduling=True)
    try:
        eng.generate(["a", "b"], [so.constrained(regex="[ab]{6}", temperature=0)] * 2)
        pending = eng.runner._pending
        assert pending is not None and pending.deferred is not None
        assert pending.deferred.early is not None  # its job was started ...
        pending.deferred.early._future.result(timeout=30)  # ... and ends by itself
        for _ in range(300):  # (its done callback runs just after its result is set)
            if sys.getswitchinterval() == interval:
                break
            time.sleep(0.01)
        assert sys.getswitchinterval() == interval
    finally:
        eng.shutdown()


def test_fill_threads_bounded():
    assert 1 <= fill_threads() <= 4


def test_shutdown_with_a_deferred_sampling(model, tok):
    eng = so.make_engine(model, tok, async_scheduling=True)
    eng.add_request("x", so.constrained(json=so.SCHEMA, temperature=0))
    eng.add_request("y", so.constrained(regex="[ab]{9}", temperature=0))
    for _ in range(3):
        eng.step()
    pending = eng.runner._pending
    assert pending is not None and pending.deferred is not None  # queued by the next step
    eng.shutdown()  # queues it: nothing waits forever on it
    assert pending.deferred is None and pending.host is not None


def test_batch_calls_equal_xgrammars_public_calls(tok, monkeypatch):
    """BatchCalls on the matchers' FFI handles (the path taken with this xgrammar) gives the
    public batch calls' accept flags and bitmask rows, a refused token included."""
    from hf_paged.structured_output import batch_calls
    from hf_paged.structured_output.compiler import GrammarService
    from hf_paged.structured_output.constraint import StructuredOutputs

    assert batch_calls._core() is not None  # the installed xgrammar takes the fast path
    service = GrammarService(tok, len(tok))
    compiled = service.submit(StructuredOutputs(regex="[ab]{3}")).compiled
    service.shutdown()
    a, b, bad = tok.convert_tokens_to_ids(["a", "b", "{"])
    eos = {tok.eos_token_id}
    width = (len(tok) + 31) // 32
    got = {}
    for way in ("handles", "public"):
        if way == "public":
            monkeypatch.setattr(batch_calls, "_core", lambda: None)
        calls = BatchCalls(2)
        rows = [RowMatcher(compiled, eos) for _ in range(3)]
        assert all((r.handle is r.matcher) == (way == "public") for r in rows)
        result = calls.accept([r.handle for r in rows], [a, bad, b])
        flags = (BatchCalls.all_accepted(result), BatchCalls.accepted(result))
        every = calls.accept([rows[0].handle, rows[2].handle], [b, a])
        bitmask = torch.zeros(4, width, dtype=torch.int32)
        calls.fill([r.handle for r in rows], bitmask, [3, 0, 1])
        got[way] = (flags, BatchCalls.all_accepted(every), bitmask)
    assert got["handles"][0] == got["public"][0] == (False, [True, False, True])
    assert got["handles"][1] is got["public"][1] is True
    assert torch.equal(got["handles"][2], got["public"][2])
    assert allowed_ids(got["handles"][2][1], len(tok)) == sorted([a, b])  # "ba": a third letter
    assert not got["handles"][2][2].any()  # a row not filled


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_runner_gives_the_sampler_its_rows_feature_bits(
    model, tok, monkeypatch, async_scheduling
):
    """The runner passes the sampler every feature bit of the rows it samples (from its arrays,
    so the sampler does not OR them row by row): exactly the rows' bits, in deferred and in-line
    steps of a batch that mixes constrained, sampled and plain greedy rows."""
    from hf_paged.sample.sampler import Sampler

    real_call = Sampler.__call__
    seen = []

    def call(self, logits, rows, pool=None, grammar=None, features=None):
        want = 0
        for r in rows:
            want |= r.features
        seen.append((features, want))
        return real_call(self, logits, rows, pool, grammar, features)

    monkeypatch.setattr(Sampler, "__call__", call)
    run(model, tok, async_scheduling=async_scheduling)
    assert len(seen) > 5 and all(got == want for got, want in seen), seen
    assert len({want for _, want in seen}) > 1  # steps with different sets of bits


def test_repeat_of_a_steady_job_equals_reading_the_rows(tok):
    """gather() on the last steady job's rows, each one token on, repeats that job's lists
    (GrammarBitmask.repeat) and gives what reading the rows one by one gives: rows, bitmask,
    counts. It reads the rows instead when they differ, when a row has more than one new token,
    when one sampled a stop token, or when the last job had a row that did not go on."""
    from hf_paged.structured_output.compiler import GrammarService
    from hf_paged.structured_output.constraint import StructuredOutputs

    service = GrammarService(tok, len(tok))
    compiled = service.submit(StructuredOutputs(regex="[ab]{20}c?")).compiled
    service.shutdown()
    a, b, bad = tok.convert_tokens_to_ids(["a", "b", "{"])
    eos = tok.eos_token_id
    vocab = len(tok)

    def rows_of(histories):
        rows = [
            Row(f"r{i}", RowMatcher(compiled, {eos}), [5, 6, *h]) for i, h in enumerate(histories)
        ]
        return rows[:1] + [Row("plain", None, [5, 6])] + rows[1:]

    repeated, read = GrammarBitmask(torch.device("cpu")), GrammarBitmask(torch.device("cpu"))
    real_repeat = GrammarBitmask.repeat

    def step(rows_a, rows_b, tokens):
        for rows in (rows_a, rows_b):  # each constrained row samples its token
            for row, t in zip([r for r in rows if r.structured], tokens):
                row.token_ids.append(t)
        got = repeated.prepare(rows_a, vocab)
        want = read.prepare(rows_b, vocab)
        read._forget()  # (the reference always reads the rows)
        assert got.sel == want.sel and set(got.failed) == set(want.failed)
        assert torch.equal(got.bitmask[got.sel], want.bitmask[want.sel])
        lag = repeated._last.lag if repeated._last is not None else 0  # (steady steps uncounted)
        counts = [r.structured.num_accepted + lag for r in rows_a if r.structured]
        assert counts == [r.structured.num_accepted for r in rows_b if r.structured]
        return got

    hits = []  # what repeat() gave the engine-side GrammarBitmask, call by call

    def repeat(self, rows, v):
        job = real_repeat(self, rows, v)
        if self is repeated:
            hits.append(job)
        return job

    GrammarBitmask.repeat = repeat
    try:
        rows_a, rows_b = rows_of([[], [], []]), rows_of([[], [], []])
        repeated.prepare(rows_a, vocab), read.prepare(rows_b, vocab)  # first tokens: replays
        step(rows_a, rows_b, [a, b, a])  # one token a row: read, steady from now on
        assert hits[-1] is None
        step(rows_a, rows_b, [b, b, a])  # the same rows one token on: repeated
        assert hits[-1] is not None and hits[-1].one_tokens == [b, b, a]
        rows_a[0].token_ids.append(a)  # a row two tokens on: read
        rows_b[0].token_ids.append(a)
        step(rows_a, rows_b, [a, a, b])
        assert hits[-1] is None
        step(rows_a, rows_b, [b, a, a])  # read (the last job replayed a row), steady
        assert hits[-1] is None
        step(rows_a, rows_b, [a, b, b])  # repeated
        assert hits[-1] is not None and hits[-1].one_tokens == [a, b, b]
        for rows in (rows_a, rows_b):  # two tokens on one row, none on another: read
            rows[0].token_ids.append(b)
            rows[2].token_ids.pop()
        step(rows_a, rows_b, [a, a, a])
        assert hits[-1] is None
        step(rows_a, rows_b, [b, b, b])  # steady again
        assert hits[-1] is None
        step(rows_a, rows_b, [a, a, a])
        assert hits[-1] is not None
        mask = step(rows_a, rows_b, [a, eos, bad])  # a stop token (too early), a refused token
        assert hits[-1] is None and mask.sel == [0] and set(mask.failed) == {"r1", "r2"}
        step(rows_a[:2], rows_b[:2], [b])  # other rows (the failed ones ended): read
        assert hits[-1] is None
    finally:
        GrammarBitmask.repeat = real_repeat
        repeated.close()
        read.close()
