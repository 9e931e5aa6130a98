"""Structured output under asynchronous scheduling: the grammar's host work (accepting the last
step's tokens, filling the bitmask) runs on the runner's helper thread while the step loop's
thread handles the previous step's output (hf_paged/structured_output/grammar_step.py). The
tokens must equal the synchronous engine's whichever thread gets to the previous step's tokens
first."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from hf_paged import SamplingParams
from hf_paged.structured_output.grammar_step import GrammarStep, landed_tokens
from hf_paged.structured_output.logits_mask import RowMatcher, fill_threads
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


def test_helper_thread_gives_the_synchronous_tokens(model, tok, monkeypatch):
    threads = []
    real = GrammarStep._prepare

    def spy(self, *args):
        threads.append(threading.current_thread().name)
        return real(self, *args)

    released_while_deferred = []
    real_release = ModelRunner.release

    def spy_release(self, req_ids):
        pending = self._pending
        if pending is not None and pending.deferred is not None:
            rows = {self.input_batch.req_to_row.get(r) for r in req_ids}
            released_while_deferred.extend(rows & set(pending.rows.tolist()))
        return real_release(self, req_ids)

    monkeypatch.setattr(GrammarStep, "_prepare", spy)
    monkeypatch.setattr(ModelRunner, "release", spy_release)
    sync = run(model, tok, async_scheduling=False)
    assert not threads  # the synchronous engine prepares the bitmask in the sampler
    overlapped = run(model, tok, async_scheduling=True)
    assert threads and all(t.startswith("hf_paged-grammar") for t in threads)
    assert overlapped == sync
    # requests ended and their rows were released while a step that samples them waited
    assert released_while_deferred


@pytest.mark.parametrize("order", ["helper first", "step loop first"])
def test_either_thread_may_land_the_last_tokens_first(model, tok, monkeypatch, order):
    """The helper takes the previous step's tokens from the landing buffer when the row's
    history does not hold them yet, and from the history when the step loop landed them."""
    real_submit = GrammarStep.submit
    real_prepare = GrammarStep._prepare

    def inline(self, rows, vocab, row_ids, epochs, previous=None):
        done = Future()  # prepared now, before the step loop handles the last step's output
        done.set_result(real_prepare(self, list(rows), vocab, row_ids, epochs, previous))
        return done

    def late(self, *args):
        time.sleep(0.02)  # the step loop lands the tokens meanwhile
        return real_prepare(self, *args)

    if order == "helper first":
        monkeypatch.setattr(GrammarStep, "submit", inline)
    else:
        monkeypatch.setattr(GrammarStep, "_prepare", late)
    sync = run(model, tok, async_scheduling=False)
    assert run(model, tok, async_scheduling=True) == sync
    monkeypatch.setattr(GrammarStep, "submit", real_submit)


def test_preempted_rows_replay_under_the_overlap(model, tok):
    """Few blocks: rows are rebuilt after preemption while the helper works; the rebuilt
    row's matcher replays its history, and the tokens equal the synchronous engine's."""
    small = dict(num_blocks=16, block_size=8, enable_prefix_caching=True)
    sync = run(model, tok, async_scheduling=False, **small)
    assert run(model, tok, async_scheduling=True, **small) == sync


def test_landed_tokens_match_row_and_epoch():
    class Pending:
        deferred = None
        rows = np.array([4, 7, 9])
        epochs = np.array([1, 2, 3])
        positions = np.array([10, 20, 30])

        def wait(self):
            return np.array([101, 102, 103])

    got = landed_tokens(Pending(), np.array([9, 7, 4, 5]), np.array([3, 9, 1, 1]))
    # row 9 same epoch, row 7 changed hands (another epoch), row 4 same, row 5 not sampled
    assert got == {0: (30, 103), 2: (10, 101)}
    deferred = Pending()
    deferred.deferred = object()
    deferred.wait = None  # a deferred step's wait refuses; landed_tokens must not get there
    with pytest.raises(RuntimeError, match="launched before"):
        landed_tokens(deferred, np.array([4]), np.array([1]))


def test_unseen_takes_the_landed_token_once(tok):
    from hf_paged.structured_output.compiler import GrammarService
    from hf_paged.structured_output.constraint import StructuredOutputs

    service = GrammarService(tok, len(tok))
    compiled = service.submit(StructuredOutputs(regex="[ab]{4}")).compiled
    service.shutdown()
    state = RowMatcher(compiled, {tok.eos_token_id})
    history = [5, 6, 11, 12]  # two prompt tokens, two outputs
    assert state.unseen(list(history), 2) == [11, 12]
    assert state.unseen(list(history), 2, landed=(4, 13)) == [11, 12, 13]
    assert state.unseen(list(history), 2, landed=(3, 12)) == [11, 12]  # already in history
    state.num_accepted = 2
    assert state.unseen(list(history), 2, landed=(4, 13)) == [13]


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
    eng.shutdown()  # queues it (nothing waits forever on it) and stops the helper
    assert pending.deferred is None and pending.host is not None
    assert eng.runner.grammar_step._pool is None
