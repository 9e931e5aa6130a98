"""Decode steps whose rows all sample in the kernels draw in a sampling graph of their own
(hf_paged/worker/decode_sampling.py), run without capture (CudaGraphRunner(eager=True)) on the
CPU with the sampling kernels interpreted (attention by the torch backend: interpreted attention
kernels cost ~30 s a test and are not what these test): seeded requests give the tokens of the
engine without graphs (the sampler's path), for the candidate-list kernel, the search kernel,
padded buckets and rows that change mid-run, penalised rows (their counts kept on the device,
inside the graph); batches the kernels cannot take whole go through the sampler; unseeded runs
repeat under torch.manual_seed. Capture and replay on a GPU: tests/test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch
from hf_paged.kernels.sampling_topk import list_length

from hf_paged import Engine, SamplingParams
from hf_paged.sample.metadata import SamplingRow
from hf_paged.worker.cuda_graphs import CudaGraphRunner
from hf_paged.worker.decode_sampling import graph_kernel


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _generate(model, prompts, params, graphs: bool, **opts):
    eng = Engine(model, attention_backend="torch", block_size=8, max_num_seqs=5, **opts)
    if graphs:
        eng.runner.graphs = CudaGraphRunner(eng.runner, eager=True)
        eng.runner.graphs.capture()
    calls = {"sampler": 0}
    real = eng.runner.sampler

    def counting(*a, **k):
        calls["sampler"] += 1
        return real(*a, **k)

    eng.runner.sampler = counting
    outs = eng.generate(prompts, params)
    eng.check_invariants()
    if graphs:
        calls["graph draws"] = eng.runner.graphs.sampling.replays
        calls["decode replays"] = eng.runner.graphs.replays["decode"]
    eng.runner.sampler = real  # (its grammar helper is closed at shutdown)
    eng.shutdown()
    return [o.output_token_ids for o in outs], calls


def _seeded(n, **opts):
    base = dict(temperature=1.3, ignore_eos=True)
    base.update(opts)
    return [SamplingParams(max_tokens=m, seed=100 + i, **base) for i, m in enumerate(n)]


CASES = {
    # every row's top_k in a candidate list: kernels/sampling_topk.py
    "top-k list": dict(top_k=20, top_p=0.9),
    # no row with a top_k: kernels/sampling.py
    "search": dict(top_p=0.8, min_p=0.02),
}
# penalties inside the sampling graph (worker/decode_penalties.py), strong enough to move tokens
PENALTIES = {
    "repetition": dict(top_k=20, repetition_penalty=1.8),
    "presence + frequency": dict(top_p=0.9, presence_penalty=0.8, frequency_penalty=0.6),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_decode_draws_equal_the_sampler(tiny_model, case, async_scheduling):
    model = tiny_model("llama")
    # batch 3 padded to the bucket of 4; one request ends early, so the rows change mid-run
    prompts = _prompts([9, 20, 4], seed=2)
    params = _seeded([7, 3, 7], **CASES[case])
    opts = dict(async_scheduling=async_scheduling)
    want, _ = _generate(model, prompts, params, graphs=False, **opts)
    got, calls = _generate(model, prompts, params, graphs=True, **opts)
    assert got == want
    assert [len(t) for t in got] == [7, 3, 7]
    # every decode step drew in the sampling graph; the sampler ran for the prefill steps only
    assert calls["graph draws"] == calls["decode replays"] >= 5
    assert calls["sampler"] == 1
    # the draws are not the greedy tokens: the test can tell sampling from argmax
    greedy, _ = _generate(model, prompts, SamplingParams(max_tokens=7, temperature=0), False)
    assert got[0] != greedy[0] or got[2] != greedy[2]


def test_batches_the_kernels_cannot_take_whole_use_the_sampler(tiny_model):
    model = tiny_model("llama")
    prompts = _prompts([9, 20, 4], seed=3)
    cases = [
        # a top-k row and a row without one: two kernels
        _seeded([6, 6, 6], top_k=20)[:2] + _seeded([6], top_p=0.9),
        # a greedy row beside sampling rows
        _seeded([6, 6], top_k=20) + [SamplingParams(max_tokens=6, temperature=0)],
    ]
    for params in cases:
        want, _ = _generate(model, prompts, params, graphs=False)
        got, calls = _generate(model, prompts, params, graphs=True)
        assert got == want
        assert calls["graph draws"] == 0 and calls["sampler"] >= calls["decode replays"] >= 5


@pytest.mark.parametrize("case", list(PENALTIES))
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalised_decode_draws_in_the_graph_equal_the_sampler(tiny_model, case, async_scheduling):
    model = tiny_model("llama")
    # batch 3 padded to 4; the middle request ends early (the rows change mid-run); the last
    # row has no penalty (identity values in the graph, its tokens not counted)
    prompts = _prompts([9, 20, 4], seed=5)
    plain = {k: v for k, v in PENALTIES[case].items() if not k.endswith("_penalty")}
    params = _seeded([8, 3], **PENALTIES[case]) + _seeded([8, 8, 8], **plain)[2:]
    opts = dict(async_scheduling=async_scheduling)
    want, _ = _generate(model, prompts, params, graphs=False, **opts)
    got, calls = _generate(model, prompts, params, graphs=True, **opts)
    assert got == want
    assert [len(t) for t in got] == [8, 3, 8]
    assert calls["graph draws"] == calls["decode replays"] >= 6
    assert calls["sampler"] == 1
    # the penalties moved the tokens: a graph that ignored them would differ
    unpenalised, _ = _generate(model, prompts, _seeded([8, 3, 8], **plain), True, **opts)
    assert got[0] != unpenalised[0]


def test_unseeded_draws_follow_torch_manual_seed(tiny_model):
    model = tiny_model("llama")
    prompts = _prompts([9, 20, 4, 13], seed=4)
    params = SamplingParams(max_tokens=8, temperature=1.5, top_k=30, ignore_eos=True)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        got, calls = _generate(model, prompts, params, graphs=True)
        assert calls["graph draws"] >= 5
        runs.append(got)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def _row(**opts):
    params = SamplingParams(**opts)
    return SamplingRow("r", params, None, [1, 2], 2)


def test_graph_kernel_choice():
    vocab = 1000
    assert graph_kernel([_row(temperature=0.7, top_k=50)], vocab) == list_length(50)
    mixed_k = [_row(temperature=0.7, top_k=50), _row(temperature=1.0, top_k=300)]
    assert graph_kernel(mixed_k, vocab) == list_length(300)
    assert graph_kernel([_row(temperature=0.7, top_p=0.9), _row(min_p=0.1)], vocab) == 0
    assert graph_kernel([_row(temperature=0.7, top_k=vocab)], vocab) == 0  # k off: search
    penalised = [_row(temperature=0.7, top_k=50, repetition_penalty=1.1), _row(top_k=8)]
    assert graph_kernel(penalised, vocab) == list_length(50)
    assert graph_kernel([_row(temperature=0.7, presence_penalty=0.5)], vocab) == 0
    refused = [
        [_row(temperature=0.7, top_k=50), _row(temperature=0.7)],  # two kernels
        [_row(temperature=0)],  # greedy
        [_row(temperature=0.7, typical_p=0.9)],
        [_row(temperature=0.7, logprobs=1)],
        [_row(temperature=0.7, output_scores=True)],
    ]
    for rows in refused:
        assert graph_kernel(rows, vocab) is None, rows[-1].params
