"""Random add / abort / step schedules through the whole Engine (real tiny model): n > 1 forks,
penalties, priorities, preemption under a small cache. Block accounting must hold after every
operation, running requests never exceed max_num_seqs, and every request ends."""

from __future__ import annotations

import random

import pytest

from hf_paged import Engine, SamplingParams
from hf_paged.testing import drive_engine


@pytest.mark.parametrize("seed", range(6))
def test_random_engine_schedules_keep_invariants(seed, tiny_model):
    rnd = random.Random(seed)
    engine = Engine(
        tiny_model("llama"),
        max_num_seqs=rnd.choice([3, 5, 8]),
        block_size=4,
        num_blocks=rnd.choice([16, 20, 28]),
        max_num_batched_tokens=rnd.choice([8, 16, 64]),
        scheduling_policy=rnd.choice(["fcfs", "priority"]),
    )
    added: list[str] = []
    for _ in range(rnd.randint(4, 9)):
        prompt = [rnd.randrange(3, 256) for _ in range(rnd.randint(1, 40))]
        params = SamplingParams(
            max_tokens=rnd.randint(1, 20),
            n=rnd.choice([1, 1, 2, 3]),
            temperature=rnd.choice([0.0, 1.0]),
            seed=rnd.choice([None, 5]),
            repetition_penalty=rnd.choice([1.0, 1.3]),
        )
        added.append(engine.add_request(prompt, params, priority=rnd.randint(0, 3)))
        for _ in range(rnd.randint(0, 3)):
            if engine.has_unfinished_requests():
                engine.step()
        if rnd.random() < 0.2:
            rid = rnd.choice(added)
            if rid in engine.scheduler.requests:
                engine.abort(rid)
        engine.check_invariants()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert steps < 2000, "no progress"
        assert len(engine.scheduler.running) <= engine.config.max_num_seqs
        engine.check_invariants()
    engine.check_invariants()


@pytest.mark.parametrize("seed", range(10))
def test_random_schedules_async_scheduling_equals_sync(seed, tiny_model):
    """Same op sequence through a synchronous and an asynchronous engine: requests neither
    aborted (in either) give the same tokens; some ask for history-reading options (forcing
    synchronous steps), small caches force preemption of requests whose token is in flight."""
    rnd = random.Random(100 + seed)
    opts = dict(
        max_num_seqs=rnd.choice([3, 5, 8]),
        block_size=4,
        num_blocks=rnd.choice([10, 12, 16]),
        max_num_batched_tokens=rnd.choice([8, 16, 64]),
        scheduling_policy=rnd.choice(["fcfs", "priority"]),
        attention_backend="torch",
    )
    ops: list = []
    for _ in range(rnd.randint(4, 9)):
        prompt = [rnd.randrange(3, 256) for _ in range(rnd.randint(1, 20))]
        params = SamplingParams(
            max_tokens=rnd.randint(1, 20),
            temperature=rnd.choice([0.0, 0.0, 1.0]),
            seed=7,
            repetition_penalty=rnd.choice([1.0, 1.0, 1.0, 1.3]),
            stop_token_ids=rnd.choice([None, [rnd.randrange(3, 256) for _ in range(30)]]),
        )
        ops.append(("add", prompt, params, rnd.randint(0, 3)))
        ops += [("step",)] * rnd.randint(0, 2)
        if rnd.random() < 0.2:
            ops.append(("abort", rnd.randrange(100)))
    model = tiny_model("llama")
    sync = drive_engine(Engine(model, async_scheduling=False, **opts), ops)
    engine = Engine(model, async_scheduling=True, **opts)
    got = drive_engine(engine, ops)
    both = sync.keys() & got.keys()
    assert both
    assert {rid: got[rid] for rid in both} == {rid: sync[rid] for rid in both}
