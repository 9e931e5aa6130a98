"""Structured output under asynchronous scheduling: a constrained step's sampling is deferred
until the step loop has handled the previous step's output and prepared the next step, so the
grammar's host work (accepting the last tokens, filling the bitmask) overlaps the forward
(ModelRunner._defer_sampling). The tokens must equal the synchronous engine's."""

from __future__ import annotations

import pytest

from hf_paged import SamplingParams
from hf_paged.engine.core import EngineCore
from hf_paged.structured_output.constraint import import_xgrammar
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
    order = []  # what the step loop did, in order
    real_prepare = GrammarBitmask.prepare
    real_resolve = EngineCore._resolve_inflight
    real_release = ModelRunner.release
    released_while_deferred = []

    def prepare(self, *args):
        order.append("prepare")
        return real_prepare(self, *args)

    def resolve(self):
        order.append("resolve")
        return real_resolve(self)

    def release(self, req_ids):
        pending = self._pending
        if pending is not None and pending.deferred is not None:
            rows = {self.input_batch.req_to_row.get(r) for r in req_ids}
            released_while_deferred.extend(rows & set(pending.rows.tolist()))
        return real_release(self, req_ids)

    monkeypatch.setattr(GrammarBitmask, "prepare", prepare)
    monkeypatch.setattr(EngineCore, "_resolve_inflight", resolve)
    monkeypatch.setattr(ModelRunner, "release", release)
    sync = run(model, tok, async_scheduling=False)
    order.clear()
    overlapped = run(model, tok, async_scheduling=True)
    assert overlapped == sync
    # a deferred step's bitmask is prepared after the previous step's output was handled (each
    # prepare follows a resolve), so its tokens were in the rows without waiting for them
    pairs = list(zip(order, order[1:]))
    assert ("resolve", "prepare") in pairs and ("prepare", "prepare") not in pairs
    # requests ended and their rows were released while a step that samples them waited
    assert released_while_deferred


def test_preempted_rows_replay_under_the_overlap(model, tok):
    """Few blocks: rows are rebuilt after preemption while the helper works; the rebuilt
    row's matcher replays its history, and the tokens equal the synchronous engine's."""
    small = dict(num_blocks=16, block_size=8, enable_prefix_caching=True)
    sync = run(model, tok, async_scheduling=False, **small)
    assert run(model, tok, async_scheduling=True, **small) == sync


def test_unseen_and_batched_accept(tok):
    from hf_paged.structured_output.compiler import GrammarService
    from hf_paged.structured_output.constraint import StructuredOutputs

    service = GrammarService(tok, len(tok))
    compiled = service.submit(StructuredOutputs(regex="[ab]{4}")).compiled
    service.shutdown()
    a, b, bad = tok.convert_tokens_to_ids(["a", "b", "{"])
    assert bad != tok.unk_token_id
    states = [RowMatcher(compiled, {tok.eos_token_id}) for _ in range(3)]
    assert states[0].unseen([5, 6, a, b], 2) == [a, b]
    # one new token a row: one batched call; a refused token leaves its matcher before it
    refused = GrammarBitmask._accept(import_xgrammar(), states, [[a], [b], [bad]])
    assert refused == [None, None, bad]
    assert [s.num_accepted for s in states] == [1, 1, 0]
    # a row replaying several tokens (rebuilt after preemption) accepts them one by one
    refused = GrammarBitmask._accept(import_xgrammar(), states, [[b, a], [a], [a, bad, b]])
    assert refused == [None, None, bad]
    assert [s.num_accepted for s in states] == [3, 2, 1]
    assert states[0].unseen([5, 6, a, b, a], 2) == []


def test_fill_threads_bounded():
    assert 1 <= fill_threads() <= 8


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
