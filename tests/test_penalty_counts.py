"""The penalty pool's bookkeeping (hf_paged/sample/token_counts.py) when tokens are counted both
ways: at the draw inside a sampling graph (worker/decode_penalties.py) and from the host history on
the sampler's path. Whatever the order of the two, each row's counts equal its output tokens,
none counted twice, and a run of graph draws needs no sync."""

from __future__ import annotations

import torch

from hf_paged import SamplingParams
from hf_paged.sample.logits_processing import _apply_penalties
from hf_paged.sample.metadata import SamplingRow
from hf_paged.sample.token_counts import TokenCountPool
from hf_paged.worker.decode_penalties import GraphPenalties

VOCAB = 16


def _row(name, prompt, **opts):
    return SamplingRow(
        name, SamplingParams(temperature=1.0, **opts), None, list(prompt), len(prompt)
    )


def _expected(outputs: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=VOCAB).int()


def test_graph_draws_and_sampler_steps_count_each_token_once():
    pool = TokenCountPool(torch.device("cpu"))
    a = _row("a", [1, 2, 3], repetition_penalty=1.2)
    b = _row("b", [4], frequency_penalty=0.5)
    c = _row("c", [5, 6])  # no penalty: in the graph's batch, never counted
    batch = [a, c, b]
    pen = GraphPenalties(8, torch.device("cpu"))
    pen.send(batch, 4)
    assert pen.rows == [a, b]
    outputs = {"a": [], "b": []}
    step = 0

    def graph_step(tokens):  # what DecodeSampling.draw does around the graph
        nonlocal step
        step += 1
        pen.sync(pool, VOCAB, step)
        drawn = torch.tensor(tokens + [0], dtype=torch.long)  # padded to the bucket of 4
        pen.count(drawn, pool, 4)
        pen.drew(pool, step)
        for r, t in zip(batch, tokens):
            if r is not c:
                outputs[r.req_id].append(t)

    def land(tokens):  # the host reads the tokens later (asynchronous scheduling)
        for r, t in zip(batch, tokens):
            r.token_ids.append(t)

    def sampler_step(tokens):  # the sampler's path: counted at the next sync, from the history
        nonlocal step
        step += 1
        pool.sync([a, b], VOCAB)
        for r, t in zip(batch, tokens):
            r.token_ids.append(t)
            if r is not c:
                outputs[r.req_id].append(t)

    graph_step([7, 8, 7])
    land([7, 8, 7])
    graph_step([7, 9, 2])
    # the next step continues the run: no sync, nothing pending
    assert pool.continues(pen.rows, step + 1) and not pool.continues(pen.rows, step + 2)
    assert not pool.continues([a, b], step + 1)  # another row set: not this run
    graph_step([3, 9, 3])
    land([7, 9, 2])
    land([3, 9, 3])
    sampler_step([11, 12, 11])  # breaks the run: the graph's draws are credited first
    assert (a.penalty_num_counted, b.penalty_num_counted) == (3, 3)
    assert pool.counted_before(a, len(a.token_ids) - 1)
    assert not pool.counted_before(a, len(a.token_ids))  # the sampler's token: not yet
    graph_step([5, 0, 5])  # syncs the sampler's token from the history
    graph_step([5, 0, 1])
    pool.settle()
    assert (a.penalty_num_counted, b.penalty_num_counted) == (6, 6)
    for r in (a, b):
        want = _expected(outputs[r.req_id])
        assert torch.equal(pool.output_counts[r.penalty_slot], want), r.req_id
    assert c.penalty_slot == -1
    # a later sync adds nothing: the graph's tokens landing in the history are skipped
    land([5, 0, 5])
    land([5, 0, 1])
    pool.sync([a, b], VOCAB)
    for r in (a, b):
        assert torch.equal(pool.output_counts[r.penalty_slot], _expected(outputs[r.req_id]))


def test_graph_penalties_equal_the_sampler_path_and_leave_other_rows_unchanged():
    # apply() (kernels/penalties.py, interpreted) on a bucket: penalised rows as the torch
    # penalties of the sampler's CPU path, the row without a penalty and the padding row exact
    pool = TokenCountPool(torch.device("cpu"))
    a = _row("a", [1, 3, 3], presence_penalty=0.7, frequency_penalty=0.2, repetition_penalty=1.5)
    a.token_ids += [3, 9, 9, 4]  # outputs, counted from the history at the first sync
    c = _row("c", [2, 9])
    b = _row("b", [5], repetition_penalty=0.7)
    pen = GraphPenalties(4, torch.device("cpu"))
    pen.send([c, a, b], 4)
    pen.sync(pool, VOCAB, 1)
    assert pen.slots[:4].tolist() == [0, a.penalty_slot, b.penalty_slot, 0]
    assert pen.values[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]  # the identity, not counted
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, VOCAB, generator=g) * 3
    x[1, 9] = float("-inf")
    got = pen.apply(x, pool, 4)
    want = _apply_penalties(x, [c, a, b, None], [1, 2], pool)
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 3]], x[[0, 3]])
    assert not torch.equal(got[1], x[1]) and not torch.equal(got[2], x[2])
