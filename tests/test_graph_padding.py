"""The CUDA-graph runner's static, padded inputs, run without capture (CudaGraphRunner(eager=True))
on the CPU with the Triton kernels interpreted: decode batches padded to a batch bucket, mixed
prefill/decode steps padded to a token bucket with empty sequences and unowned tokens. Greedy
output must equal the engine without graphs. Capture and replay themselves are GPU tests
(tests/test_gpu_engine.py)."""

from __future__ import annotations

import random

import pytest
import torch

from hf_paged import Engine, SamplingParams
from hf_paged.testing import drive_engine
from hf_paged.worker import graph_inputs
from hf_paged.worker.cuda_graphs import CudaGraphRunner, graph_buckets, token_buckets


def test_token_buckets():
    assert token_buckets(0) == []
    assert token_buckets(40) == [32, 40]
    assert token_buckets(2048)[:6] == [32, 64, 96, 128, 192, 256]
    assert {512, 640, 1024, 1280, 2048} <= set(token_buckets(2048))
    assert token_buckets(2048)[-1] == 2048 and 576 not in token_buckets(2048)
    assert token_buckets(1000)[-1] == 1000
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    # the small-batch forward's steps: buckets of their own up to its largest
    assert token_buckets(40, small_rows=2) == [2, 32, 40]
    assert token_buckets(40, small_rows=8) == [2, 4, 8, 32, 40]
    assert token_buckets(40, small_rows=6) == [2, 4, 6, 32, 40]
    assert token_buckets(5, small_rows=8) == [2, 4, 5]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _run(model, prompts, params, graphs: bool, **opts):
    eng = Engine(model, attention_backend="triton", **opts)
    if graphs:  # CPU: no capture, but the same padded buffers and bucket choice as on CUDA
        eng.runner.graphs = CudaGraphRunner(eng.runner, eager=True)
        eng.runner.graphs.capture()
    outs = eng.generate(prompts, params)
    eng.check_invariants()
    replays = dict(eng.runner.graphs.replays) if graphs else None
    eng.shutdown()
    return [o.output_token_ids for o in outs], replays


@pytest.mark.parametrize(
    ("async_scheduling", "table_bytes"), [(False, None), (True, None), (True, 0), (False, 200)]
)
def test_padded_graph_inputs_change_no_greedy_output(
    tiny_model, async_scheduling, table_bytes, monkeypatch
):
    # table_bytes: every graph's block table in its packed inputs (None: the default limit, which
    # this tiny model's tables fit), none of them (0), or only those of <= 200 bytes (some each)
    if table_bytes is not None:
        monkeypatch.setattr(graph_inputs, "PACKED_TABLE_BYTES", table_bytes)
    model = tiny_model("llama")
    # a 48-token budget with 5 seats: prompt chunks share steps with decodes (mixed steps of
    # 2..48 tokens, padded to 32 or 48 with empty sequences), then decode batches of 1..5
    # padded to 1, 2, 4 or 5
    opts = dict(
        block_size=8,
        max_num_batched_tokens=48,
        max_num_seqs=5,
        max_graph_tokens=48,
        async_scheduling=async_scheduling,
    )
    prompts = _prompts([1, 40, 23, 7, 45, 3])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (7, 4, 9, 3)]
    params = [params[i % len(params)] for i in range(len(prompts))]
    want, _ = _run(model, prompts, params, graphs=False, **opts)
    got, replays = _run(model, prompts, params, graphs=True, **opts)
    assert got == want
    assert replays["mixed"] > 0 and replays["decode"] > 0


def test_mixed_graphs_off_and_oversized_steps_run_eagerly(tiny_model):
    model = tiny_model("llama")
    prompts = _prompts([40, 9])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want, _ = _run(model, prompts, params, graphs=False, block_size=8)
    # every prefill step is above the 32-token bucket, or mixed graphs are off: op by op
    for limit in (0, 32):
        got, replays = _run(
            model, prompts, params, graphs=True, block_size=8, max_graph_tokens=limit
        )
        assert got == want
        assert replays["mixed"] == 0 and replays["decode"] > 0


def test_prompt_logprob_steps_run_eagerly(tiny_model):
    model = tiny_model("llama")
    prompts = _prompts([20, 6], seed=2)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=True)
    eng = Engine(model, attention_backend="triton", block_size=8, max_graph_tokens=32)
    eng.runner.graphs = CudaGraphRunner(eng.runner, eager=True)
    eng.runner.graphs.capture()
    out = eng.generate(prompts, params)
    assert eng.runner.graphs.replays["mixed"] == 0
    ref = Engine(model, attention_backend="triton", block_size=8).generate(prompts, params)
    for a, b in zip(out, ref):
        assert a.output_token_ids == b.output_token_ids
        assert a.prompt_logprobs == pytest.approx(b.prompt_logprobs, abs=1e-5)
    eng.check_invariants()


def test_max_graph_tokens_is_validated():
    from hf_paged.config import EngineConfig

    with pytest.raises(ValueError, match="max_graph_tokens"):
        EngineConfig(max_graph_tokens=-1)
    with pytest.raises(ValueError, match="max_graph_tokens"):
        EngineConfig(max_graph_tokens=1.5)


# seed 0: preemption, async, decode batches past the largest decode graph
@pytest.mark.parametrize("seed", range(2))
def test_random_schedules_padded_graph_inputs_equal_plain(seed, tiny_model):
    """Random adds / steps / aborts under chunked prefill, prefix hits and preemption (small
    cache), synchronous or not: the padded graph buffers give every request the plain engine's
    greedy tokens."""
    rnd = random.Random(200 + seed)
    opts = dict(
        max_num_seqs=rnd.choice([3, 5]),
        block_size=4,
        num_blocks=rnd.choice([10, 12, 40]),  # 10-12 blocks: preemption
        max_num_batched_tokens=rnd.choice([16, 40]),
        max_graph_tokens=40,
        # 2: decode batches above the largest decode graph replay a mixed-step graph instead
        max_graph_batch_size=rnd.choice([2, 512]),
        async_scheduling=rnd.choice([False, True]),
        attention_backend="triton",
    )
    shared = [rnd.randrange(3, 256) for _ in range(9)]  # a common prefix: cache hits
    ops: list = []
    for _ in range(rnd.randint(4, 7)):
        tail = [rnd.randrange(3, 256) for _ in range(rnd.randint(1, 14))]
        prompt = (shared if rnd.random() < 0.5 else []) + tail
        params = SamplingParams(max_tokens=rnd.randint(2, 16), temperature=0, ignore_eos=True)
        ops.append(("add", prompt, params, 0))
        ops += [("step",)] * rnd.randint(0, 2)
        if rnd.random() < 0.2:
            ops.append(("abort", rnd.randrange(100)))
    model = tiny_model("llama")
    want = drive_engine(Engine(model, **opts), ops)
    engine = Engine(model, **opts)
    engine.runner.graphs = CudaGraphRunner(engine.runner, eager=True)
    engine.runner.graphs.capture()
    got = drive_engine(engine, ops)
    assert got == want
    assert engine.runner.graphs.replays["mixed"] + engine.runner.graphs.replays["decode"] > 0


def test_packed_graph_inputs_layout_and_padding(tiny_model):
    # every graph's packed inputs: 8-byte aligned, non-overlapping fields inside the one buffer;
    # per step, the real values first, then padding that writes nothing (slot -1), attends to one
    # key (seq_len 1), takes no device token (pending False) and, for mixed graphs, starts its
    # empty sequences at the end of the real tokens
    eng = Engine(
        tiny_model("llama"), attention_backend="triton", block_size=8, max_num_seqs=5,
        max_num_batched_tokens=48, max_graph_tokens=48,
    )  # fmt: skip
    graphs = eng.runner.graphs = CudaGraphRunner(eng.runner, eager=True)
    graphs.capture()
    inputs = graphs.inputs
    for key, layout in inputs.layouts.items():
        assert "block_table" in layout, key  # this model's tables fit the packed copy
        spans = sorted((o, o + n * d.itemsize) for o, d, n in layout.values())
        assert all(a % 8 == 0 for a, _ in spans), key
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:])), key
        assert spans[-1][1] <= inputs.nbytes[key] <= inputs.packed.numel(), key
    seen = []
    real_send = inputs.send

    def send(step, key, count, table, **kw):
        real_send(step, key, count, table, **kw)
        kind, size = key
        v = {k: t.clone() for k, t in inputs[key].items()}
        # the rows' block tables as this step sent them (later steps add blocks)
        v["want_table"] = eng.runner.input_batch.block_table[step.rows, : step.max_blocks].copy()
        seen.append((kind, size, count, len(step.rows), step, v))

    inputs.send = send  # every copy to the device goes through send()
    prompts = _prompts([30, 5, 12])
    eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert {k for k, *_ in seen} == {"decode", "mixed"}
    for kind, size, count, batch, step, v in seen:
        assert v["positions"][:count].tolist() == step.positions.tolist()
        assert v["rows"][:count].tolist() == step.source.tolist()
        assert v["seq_lens"][:batch].tolist() == step.seq_lens.tolist()
        assert (v["slot_mapping"][count:] == -1).all() and (v["seq_lens"][batch:] == 1).all()
        assert not v["pending"][count:].any() and (v["input_ids"][count:] == 0).all()
        if step.pending is not None:
            assert v["pending"][:count].tolist() == step.pending.tolist()
        # the block table rows: the used columns of each real row, block 0 for padded rows
        table = v["want_table"].tolist()
        assert v["block_table"][:batch, : step.max_blocks].tolist() == table
        assert (v["block_table"][batch:, 0] == 0).all()
        if kind == "mixed":
            qsl = v["query_start_loc"].tolist()
            assert qsl[: batch + 1] == step.qsl.tolist() and set(qsl[batch + 1 :]) <= {count}
    # asynchronous scheduling (the default): decode steps read their input from last_tokens
    assert any(kind == "decode" and v["pending"][:count].all() for kind, _, count, _, _, v in seen)
    eng.check_invariants()
    eng.shutdown()
