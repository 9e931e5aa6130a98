"""Engine.generate runs inside hf_paged.gc_freeze.frozen_heap(): the objects that existed before
the call are frozen for the garbage collector during it (no full collection of them stalls the
run) and unfrozen after it, however it ends. Nested calls, a caller's own freeze and a disabled
collector are left alone."""

from __future__ import annotations

import gc
import sys

import pytest

from hf_paged import Engine, SamplingParams
from hf_paged.gc_freeze import frozen_heap


@pytest.fixture
def engine(tiny_model):
    assert gc.get_freeze_count() == 0
    eng = Engine(tiny_model("llama"), attention_backend="torch")
    yield eng
    gc.unfreeze()  # a failing test must not leave the rest of the suite frozen


def _record_freeze_counts(engine, monkeypatch) -> list[int]:
    counts: list[int] = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: counts.append(gc.get_freeze_count()) or step())
    return counts


def test_generate_runs_frozen_and_unfreezes_after(engine, monkeypatch):
    counts = _record_freeze_counts(engine, monkeypatch)
    engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, temperature=0))
    assert counts and min(counts) > 1000  # the model's, torch's and transformers' objects
    assert gc.get_freeze_count() == 0


def test_unfrozen_when_generate_raises(engine, monkeypatch):
    calls = {"n": 0}
    step = engine.step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # e.g. Ctrl-C in a notebook
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=20, temperature=0))
    assert gc.get_freeze_count() == 0
    assert not engine.has_unfinished_requests()  # the stream aborted its requests
    engine.check_invariants()


def test_nested_callers_freeze_and_disabled_collector_left_alone(engine, monkeypatch):
    params = SamplingParams(max_tokens=3, temperature=0)
    with frozen_heap():
        outer = gc.get_freeze_count()
        engine.generate([[3, 4, 5]], params)  # nested: the outer freeze stays
        assert gc.get_freeze_count() > outer // 2  # (objects freed meanwhile leave the count)
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the caller's own freeze
    engine.generate([[3, 4, 5]], params)
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
    counts = _record_freeze_counts(engine, monkeypatch)
    gc.disable()
    try:
        engine.generate([[3, 4, 5]], params)
    finally:
        gc.enable()
    assert counts and max(counts) == 0


def _in_build() -> bool:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "_build" and "engine.py" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def test_start_up_runs_no_collection_then_one_young_pass(tiny_model):
    """Engine(...) builds with the collector off (compile's objects set off full collections that
    scan the whole heap) and runs one young-generation pass after; the collector is on again
    after, also when the start-up fails, and one the caller turned off stays off. A threshold of
    1 would otherwise collect at nearly every allocation inside the build."""
    model = tiny_model("llama")
    seen: list[tuple[int, bool]] = []

    def record(phase, info):
        if phase == "start":
            seen.append((info["generation"], _in_build()))

    old = gc.get_threshold()
    gc.callbacks.append(record)
    gc.set_threshold(1, 1, 1)
    try:
        Engine(model, attention_backend="torch").shutdown()
        assert seen and not any(inside for _, inside in seen)
        assert gc.isenabled()
        seen.clear()
        with pytest.raises(ValueError, match="max_num_seqs"):
            Engine(model, attention_backend="torch", max_num_seqs=0)
        assert gc.isenabled() and not any(inside for _, inside in seen)
        gc.disable()
        seen.clear()
        try:
            Engine(model, attention_backend="torch").shutdown()
            assert not gc.isenabled() and seen == []
        finally:
            gc.enable()
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(record)
