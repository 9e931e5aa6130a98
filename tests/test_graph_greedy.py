"""The decode graph's in-graph greedy tokens (hf_paged/worker/cuda_graphs.py, kernels/argmax.py's
scatter), run without capture (CudaGraphRunner(eager=True)) on the CPU with the Triton kernels
interpreted: an all-greedy decode batch takes its tokens from the graph and skips the sampler;
any other batch still samples; padded rows never write into last_tokens. Replay itself, batch 1
and a padded batch, fp32 against graphs off: tests/test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams
from hf_paged.sample.sampler import Sampler
from hf_paged.worker.cuda_graphs import CudaGraphRunner


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


class _Watch:
    """Counts, per decode replay, whether the sampler ran after it."""

    def __init__(self, eng):
        self.decode_steps = 0
        self.pending_decode_steps = 0  # inputs read from last_tokens (asynchronous scheduling)
        self.sampled_after_decode = 0
        self.sampled = 0
        self._in_decode = False
        graphs, runner = eng.runner.graphs, eng.runner
        real_run, real_sampler = graphs.run, runner.sampler
        watch = self

        def run(step):
            watch.decode_steps += 1
            watch.pending_decode_steps += step.pending is not None and bool(step.pending.all())
            watch._in_decode = True
            return real_run(step)

        class Counting(Sampler):
            def __call__(self, logits, rows, pool=None, **options):
                watch.sampled += 1
                watch.sampled_after_decode += watch._in_decode
                return Sampler.__call__(self, logits, rows, pool, **options)

        counting = Counting(runner.device)
        counting.__dict__.update(real_sampler.__dict__)
        runner.sampler = counting
        graphs.run = run
        real_execute = runner.execute

        def execute(*args, **kwargs):
            watch._in_decode = False
            return real_execute(*args, **kwargs)

        runner.execute = execute


def _engine(model, graphs: bool, **opts):
    eng = Engine(model, attention_backend="triton", block_size=8, **opts)
    if graphs:
        eng.runner.graphs = CudaGraphRunner(eng.runner, eager=True)
        eng.runner.graphs.capture()
    return eng


def _generate(model, prompts, params, graphs: bool, **opts):
    eng = _engine(model, graphs, **opts)
    watch = _Watch(eng) if graphs else None
    outs = eng.generate(prompts, params)
    eng.check_invariants()
    eng.shutdown()
    return outs, watch


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("lengths", [[9], [9, 20, 4]])  # batch 1; batch 3 padded to 4
def test_greedy_decode_batches_take_the_graph_tokens(tiny_model, async_scheduling, lengths):
    model = tiny_model("llama")
    prompts = _prompts(lengths)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    opts = dict(max_num_seqs=5, async_scheduling=async_scheduling)
    want, _ = _generate(model, prompts, params, graphs=False, **opts)
    got, watch = _generate(model, prompts, params, graphs=True, **opts)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert all(len(o.output_token_ids) == 6 for o in got)
    # every decode step replayed a graph and took its tokens: the sampler ran for prefills only
    assert watch.decode_steps >= 5
    assert watch.sampled_after_decode == 0 and watch.sampled > 0
    assert (watch.pending_decode_steps >= 5) == async_scheduling


@pytest.mark.parametrize("logprobs", [False, True])
def test_mixed_greedy_and_sampling_batch_still_samples(tiny_model, logprobs):
    # a request that samples (seeded: its draws do not depend on the batch), and one keeping
    # logprobs, share decode graphs with plain greedy ones: those steps go through the sampler.
    # Without logprobs the steps run asynchronously, so the sampler's last_tokens write must
    # win over the graph's greedy one (the next input is read from there); logprobs make the
    # steps synchronous and must be recorded as without graphs
    model = tiny_model("llama")
    prompts = _prompts([9, 20, 4, 13], seed=1)
    greedy = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    third = SamplingParams(max_tokens=7, temperature=0, logprobs=2, ignore_eos=True)
    params = [
        greedy,
        SamplingParams(max_tokens=7, temperature=1.5, seed=11, ignore_eos=True),
        third if logprobs else greedy,
        greedy,
    ]
    opts = dict(max_num_seqs=5, async_scheduling=True)
    want, _ = _generate(model, prompts, params, graphs=False, **opts)
    got, watch = _generate(model, prompts, params, graphs=True, **opts)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    # the sampled request's tokens are not (all) its greedy ones: the test can tell them apart
    alone, _ = _generate(model, prompts[1:2], greedy, graphs=False, **opts)
    assert got[1].output_token_ids != alone[0].output_token_ids
    assert watch.decode_steps > 0 and watch.sampled_after_decode == watch.decode_steps
    if logprobs:
        assert len(got[2].logprobs) == 7
        for a, b in zip(got[2].logprobs, want[2].logprobs):
            assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()))
    else:
        assert watch.pending_decode_steps >= 5


def test_padded_rows_leave_last_tokens_alone(tiny_model):
    # batch 3 padded to bucket 4 (buckets 1, 2, 4, 5): before each replay every last_tokens
    # entry outside the step's rows holds a sentinel; after it, the real rows hold their greedy
    # tokens and the sentinels are untouched (padded rows are row -1, not row 0)
    model = tiny_model("llama")
    eng = _engine(model, True, max_num_seqs=5, async_scheduling=True)
    graphs, runner = eng.runner.graphs, eng.runner
    assert graphs.buckets == [1, 2, 4, 5]
    seen = []
    real_run = graphs.run

    def run(step):
        rows = torch.as_tensor(step.rows)
        others = torch.ones(runner.last_tokens.shape[0], dtype=torch.bool)
        others[rows] = False
        sentinel = 1000 + torch.arange(runner.last_tokens.shape[0])
        runner.last_tokens[others] = sentinel[others]
        logits = real_run(step)
        want = logits.argmax(dim=-1)
        assert torch.equal(graphs.greedy_tokens(len(rows)), want)
        assert torch.equal(runner.last_tokens[rows], want)
        assert torch.equal(runner.last_tokens[others], sentinel[others])
        # and in pinned host memory (here: a CPU tensor), in this step's landing row
        assert torch.equal(graphs.greedy_host(len(rows)), want)
        slots.append(graphs._landing)
        bucket = graphs.bucket_for(len(rows))
        assert (graphs.inputs[("decode", bucket)]["rows"][len(rows) :] == -1).all()
        seen.append((len(rows), bucket, sorted(step.rows.tolist())))
        return logits

    slots = []
    graphs.run = run
    prompts = _prompts([9, 20, 4])
    outs = eng.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert all(len(o.output_token_ids) == 5 for o in outs)
    # padded decode steps with row 0 among the real rows (what a padding row 0 would clobber)
    assert (3, 4, [0, 1, 2]) in seen
    # consecutive decode steps land in alternating rows (the host reads step n's after
    # launching step n+1)
    assert len(slots) >= 4 and all(a != b for a, b in zip(slots, slots[1:])), slots
    eng.check_invariants()
    eng.shutdown()


def test_device_advanced_inputs_are_the_steps_inputs(tiny_model):
    # Decode graphs move their own packed inputs on by a token (kernels/argmax.py
    # DecodeAdvance), and the host sends nothing when that is what the step needs: at every
    # decode replay the inputs the graph reads must be exactly the step's (sent or not), and
    # most steps of a steady batch send nothing (block_size 8: a copy every 8th step or so).
    # Three requests finishing at different steps (batch 3 -> 2 -> 1), greedy output as without
    # graphs.
    model = tiny_model("llama")
    prompts = _prompts([9, 20, 4], seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (8, 20, 14)]
    opts = dict(max_num_seqs=5, async_scheduling=True)
    want, _ = _generate(model, prompts, params, graphs=False, **opts)
    eng = _engine(model, True, **opts)
    graphs = eng.runner.graphs
    assert graphs.advance
    checked = []
    real_run, real_replay = graphs.run, graphs._replay

    def run(step):
        checked.append(step)
        return real_run(step)

    def replay(kind, size):
        if kind == "decode":
            step, v = checked[-1], graphs.inputs[("decode", size)]
            n = len(step.rows)
            assert v["positions"][:n].tolist() == step.positions.tolist()
            assert v["seq_lens"][:n].tolist() == step.seq_lens.tolist()
            assert v["slot_mapping"][:n].tolist() == step.slot_mapping.tolist()
            assert v["rows"][:n].tolist() == step.source.tolist()
            assert v["pending"][:n].all() and (v["slot_mapping"][n:] == -1).all()
        return real_replay(kind, size)

    graphs.run, graphs._replay = run, replay
    got = eng.generate(prompts, params)
    eng.check_invariants()
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    decode_steps = len(checked)
    assert decode_steps >= 17
    skipped = graphs.inputs.sends_skipped
    assert skipped >= decode_steps // 2, (skipped, decode_steps)


def test_prefix_hit_leaving_one_prompt_token_reads_the_sampled_tokens_next(tiny_model):
    # A prefix-cache hit that leaves one prompt token makes the request's first step
    # decode-shaped, its input token sent from the host (not pending). The decode graph moves
    # positions on, but the next step's input must be the token sampled on the device: the
    # device's inputs are not reused while they still read a host token (they were, and every
    # later step re-read the prompt's last token).
    model = tiny_model("llama")
    prompt = _prompts([17], seed=5)[0]  # two full blocks of 8 cached, one token left
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    opts = dict(max_num_seqs=4, async_scheduling=True)
    want = _generate(model, [prompt], params, graphs=False, **opts)[0][0].output_token_ids
    eng = _engine(model, True, **opts)
    outs = [eng.generate([prompt], params)[0] for _ in range(3)]
    got = [o.output_token_ids for o in outs]
    assert [o.num_cached_tokens for o in outs] == [0, 16, 16]
    eng.check_invariants()
    eng.shutdown()
    assert got == [want] * 3


def test_async_penalties_count_the_sampled_token_not_the_graphs(tiny_model):
    """A penalised sampling request under decode graphs, asynchronously: its in-flight token is
    counted from last_tokens as copied before the replay (the graph writes its greedy tokens
    there), so its tokens equal those without graphs."""
    model = tiny_model("llama")
    prompts = _prompts([9, 20, 4], seed=2)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    penalised = SamplingParams(
        max_tokens=8, temperature=1.5, seed=5, ignore_eos=True, frequency_penalty=3.0,
        repetition_penalty=2.0,
    )  # fmt: skip
    params = [greedy, penalised, greedy]
    opts = dict(max_num_seqs=5, async_scheduling=True)
    want, _ = _generate(model, prompts, params, graphs=False, **opts)
    got, watch = _generate(model, prompts, params, graphs=True, **opts)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert watch.pending_decode_steps >= 5 and watch.sampled_after_decode == watch.decode_steps
