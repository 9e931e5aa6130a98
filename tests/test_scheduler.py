"""Ladder step 1: the scheduler and block manager driven by fake model outputs (no model)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_paged.config import EngineConfig
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.request import Request, RequestStatus
from hf_paged.core.scheduler import ModelRunnerOutput, Scheduler
from hf_paged.sampling_params import SamplingParams

EOS = 1


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, policy="fcfs", **kw):
    cfg = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=1024,
        scheduling_policy=policy,
        **kw,
    )
    kv = KVCacheManager(num_blocks, block_size, cfg.enable_prefix_caching)
    return Scheduler(cfg, kv)


_counter = iter(range(10**9))


def add(s: Scheduler, rid: str, prompt, max_tokens=4, priority=0, eos=False) -> Request:
    req = Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens),
        frozenset({EOS}) if eos else frozenset(),
        len(prompt) + max_tokens,
        priority=priority,
        arrival_index=next(_counter),
    )
    s.add_request(req)
    return req


def fake_step(s: Scheduler, token_fn=lambda r: 7):
    out = s.schedule()
    tokens = []
    for r, n in zip(out.requests, out.num_scheduled_tokens):
        assert 0 < n <= r.num_tokens - r.num_computed_tokens
        tokens.append(token_fn(r) if r.num_computed_tokens + n == r.num_tokens else -1)
    advanced, finished = s.update_from_output(out, ModelRunnerOutput(tokens))
    s.kv.check_invariants()
    return out, advanced, finished


def run_to_end(s: Scheduler, max_steps=1000, **kw):
    steps = 0
    while s.has_unfinished_requests():
        fake_step(s, **kw)
        steps += 1
        assert steps < max_steps, "no progress"
    assert s.kv.get_num_free_blocks() == s.kv.num_blocks
    return steps


def test_token_budget_and_chunked_prefill():
    s = make_scheduler(budget=10)
    a = add(s, "a", range(25))
    b = add(s, "b", range(100, 103))
    out, _, _ = fake_step(s)
    assert out.num_scheduled_tokens == [10]  # a's first chunk takes the whole budget
    out, _, _ = fake_step(s)
    assert out.num_scheduled_tokens == [10]
    out, advanced, _ = fake_step(s)
    # a finishes its prompt (5 tokens) and samples; b gets the remaining 5 of the budget
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_scheduled_tokens == [5, 3]
    assert advanced == [a, b]
    assert a.num_computed_tokens == 25 and a.num_output_tokens == 1
    run_to_end(s)


def test_no_chunking_waits_for_room():
    s = make_scheduler(budget=10, enable_chunked_prefill=False)
    add(s, "a", range(6))
    add(s, "b", range(100, 106))
    out, _, _ = fake_step(s)
    assert out.num_scheduled_tokens == [6]  # b (6) does not fit in the remaining 4
    run_to_end(s)


def test_running_requests_served_before_waiting():
    s = make_scheduler(budget=8)
    add(s, "a", range(4), max_tokens=10)
    fake_step(s)
    add(s, "b", range(50, 70))
    out, _, _ = fake_step(s)
    assert out.requests[0].request_id == "a" and out.num_scheduled_tokens == [1, 7]


def test_max_num_seqs():
    s = make_scheduler(max_seqs=2, budget=100)
    for i in range(4):
        add(s, f"r{i}", range(i * 10, i * 10 + 3))
    out, _, _ = fake_step(s)
    assert len(out.requests) == 2
    run_to_end(s)


def test_preemption_of_newest_by_recompute():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    old = add(s, "old", range(8), max_tokens=12)
    new = add(s, "new", range(50, 58), max_tokens=12)
    fake_step(s)  # both prefilled: 4 of 6 blocks
    preempted = []
    while not preempted:
        out, _, _ = fake_step(s)
        preempted = out.preempted
    assert preempted == [new]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and s.num_preemptions == 1
    assert old.status == RequestStatus.RUNNING
    run_to_end(s)
    assert new.num_output_tokens == 12 and old.num_output_tokens == 12


def test_priority_policy_admits_and_preempts_by_priority():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, max_seqs=1, policy="priority")
    add(s, "low", range(4), priority=5)
    add(s, "high", range(10, 14), priority=0)
    out, _, _ = fake_step(s)
    assert [r.request_id for r in out.requests] == ["high"]
    run_to_end(s)

    s = make_scheduler(num_blocks=6, block_size=4, budget=64, policy="priority")
    high = add(s, "high", range(8), max_tokens=12, priority=0)
    low = add(s, "low", range(50, 58), max_tokens=12, priority=9)
    preempted = []
    while s.has_unfinished_requests() and not preempted:
        out, _, _ = fake_step(s)
        preempted = out.preempted
    assert preempted == [low] and high.status == RequestStatus.RUNNING
    run_to_end(s)


def test_eos_and_length_stops():
    s = make_scheduler()
    a = add(s, "a", range(3), max_tokens=5, eos=True)
    b = add(s, "b", range(10, 13), max_tokens=3)
    run_to_end(s, token_fn=lambda r: EOS if r.request_id == "a" else 9)
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [EOS]
    assert b.status == RequestStatus.FINISHED_LENGTH and b.output_token_ids == [9, 9, 9]


def test_abort_running_and_waiting_frees_blocks():
    s = make_scheduler(max_seqs=1)
    add(s, "a", range(10), max_tokens=50)
    add(s, "b", range(10))
    fake_step(s)
    s.abort_request("a")
    s.abort_request("b")
    assert not s.has_unfinished_requests()
    s.kv.check_invariants()
    assert s.kv.get_num_free_blocks() == s.kv.num_blocks


def test_prefix_cache_hit_skips_computation():
    s = make_scheduler(budget=256)
    add(s, "a", range(40))
    run_to_end(s)
    b = add(s, "b", range(40))
    out, _, _ = fake_step(s)
    assert b.num_cached_tokens == 36 and out.num_scheduled_tokens == [4]
    run_to_end(s)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
            st.tuples(st.just("abort"), st.integers(0, 50)),
            st.tuples(st.just("step"), st.integers(1, 3)),
        ),
        max_size=40,
    ),
    num_blocks=st.integers(16, 40),
    budget=st.integers(8, 64),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
)
def test_random_add_abort_step_keeps_invariants(ops, num_blocks, budget, policy, caching):
    s = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        budget=budget,
        max_seqs=4,
        policy=policy,
        enable_prefix_caching=caching,
    )
    ids: list[str] = []
    expected: dict[str, int] = {}
    reqs: dict[str, Request] = {}
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, prio = op
            rid = f"r{len(ids)}"
            # shared prefixes so the prefix cache is exercised
            reqs[rid] = add(s, rid, [(i % 7) + 2 for i in range(plen)], max_tokens, priority=prio)
            ids.append(rid)
            expected[rid] = max_tokens
        elif op[0] == "abort" and ids:
            rid = ids[op[1] % len(ids)]
            if rid in s.requests:
                s.abort_request(rid)
                expected.pop(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                if s.has_unfinished_requests():
                    fake_step(s)
        s.kv.check_invariants()
    run_to_end(s, max_steps=5000)
    for rid, n in expected.items():
        assert reqs[rid].num_output_tokens == n
        assert reqs[rid].status == RequestStatus.FINISHED_LENGTH
