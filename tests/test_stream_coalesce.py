"""Coalescing streams (the server's): a request's outputs that nobody took yet merge into one,
and what a consumer reads adds up to exactly what a plain stream gives; the async front wakes
the streams that hold outputs and reports every finished request to its hooks once."""

from __future__ import annotations

import asyncio

from hf_paged import Engine, SamplingParams
from hf_paged.entrypoints.async_engine import AsyncEngine
from hf_paged.testing import tiny_tokenizer

PROMPTS = [[3 + i] * (5 + 3 * i) for i in range(6)]
PARAMS = [SamplingParams(max_tokens=6 + i, temperature=0) for i in range(6)]


def test_outputs_taken_every_few_steps_merge_into_one_per_request(tiny_model):
    engine = Engine(tiny_model("llama"), max_num_batched_tokens=64)
    reference = [o.output_token_ids for o in engine.generate(PROMPTS, PARAMS)]
    stream = engine.stream(PROMPTS, PARAMS, coalesce=True)
    ids = stream.request_ids
    seen: dict[str, list[int]] = {rid: [] for rid in ids}
    finished = set()
    while engine.has_unfinished_requests():
        for _ in range(3):  # a consumer that falls behind: three steps between takes
            engine.step()
        assert stream.has_outputs
        outs = stream.poll()
        assert len({o.request_id for o in outs}) == len(outs), "one output per request"
        for out in outs:
            assert out.request_id not in finished, "an output after the final one"
            seen[out.request_id] += out.new_token_ids
            assert seen[out.request_id] == out.output_token_ids  # every token since the last take
            if out.finished:
                finished.add(out.request_id)
        assert not stream.has_outputs and stream.poll() == []
    assert finished == set(ids)
    assert [seen[rid] for rid in ids] == reference
    engine.check_invariants()


def test_iterating_a_coalescing_stream_gives_the_tokens_of_a_plain_one(tiny_model):
    engine = Engine(tiny_model("llama"), max_num_batched_tokens=64)
    got = {}
    for coalesce in (False, True):
        seen: dict[str, list[int]] = {}
        with engine.stream(PROMPTS, PARAMS, coalesce=coalesce) as stream:
            for out in stream:
                seen.setdefault(out.request_id, []).extend(out.new_token_ids)
            got[coalesce] = [seen[rid] for rid in stream.request_ids]
    assert got[True] == got[False]
    assert [len(t) for t in got[True]] == [6 + i for i in range(6)]


def test_closing_a_coalescing_stream_drops_what_it_held(tiny_model):
    engine = Engine(tiny_model("llama"))
    stream = engine.stream([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=50), coalesce=True)
    engine.step()
    engine.step()
    assert stream.has_outputs
    stream.close()
    assert not stream.has_outputs and stream.poll() == []
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()


def run_front(engine, body, **options):
    """body(front) on a started front, in a running event loop; the front is shut down after."""

    async def main():
        front = AsyncEngine(engine, **options)
        front.start()
        try:
            return front, await body(front)
        finally:
            front.shutdown()

    return asyncio.run(main())


def test_the_front_wakes_streams_and_reports_each_finished_request_once(tiny_model):
    engine = Engine(tiny_model("llama"), tiny_tokenizer(), max_num_batched_tokens=64)
    reference = [o.output_token_ids for o in engine.generate(PROMPTS, PARAMS)]
    finished = []

    async def read_all(front):
        front.on_finished.append(lambda out, name: finished.append((out.request_id, name)))
        handles = [front.submit([p], params, "m") for p, params in zip(PROMPTS, PARAMS)]

        async def read(handle):
            tokens = []
            while not handle.finished:
                for out in await handle.next_outputs():
                    tokens += out.new_token_ids
            return tokens

        return await asyncio.gather(*(read(h) for h in handles)), handles

    # paced: several steps a wake-up, so outputs wait (coalesced) in the streams
    front, (got, handles) = run_front(engine, read_all, stream_interval_s=0.002)
    assert got == reference
    assert sorted(finished) == sorted((h.request_ids[0], "m") for h in handles)
    assert front.num_steps > 0 and 0 < front.step_cpu_seconds
    assert 1 <= front.num_handoffs <= front.num_steps + 2
    t0, n0, _, _ = front.first_submit
    t1, n1, _, c1 = front.last_submit
    assert t0 <= t1 and n0 <= n1 <= front.num_steps and c1 <= front.step_cpu_seconds
    assert front.num_handles == 0 and front.num_in_flight == 0
    engine.check_invariants()


def test_a_request_that_ended_unread_is_reported_when_its_handle_closes(tiny_model):
    engine = Engine(tiny_model("llama"), tiny_tokenizer())
    finished = []

    async def submit_and_leave(front):
        front.on_finished.append(lambda out, name: finished.append(out.request_id))
        handle = front.submit([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), "m")
        while engine.has_unfinished_requests() or not handle.stream.has_outputs:
            await asyncio.sleep(0.005)  # the engine finishes it; nobody reads
        assert finished == []
        handle.close()
        handle.close()  # idempotent: reported once
        return handle

    _, handle = run_front(engine, submit_and_leave)
    assert finished == handle.request_ids
    engine.check_invariants()
