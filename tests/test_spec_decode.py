"""Speculative decoding (hf_paged/spec_decode): the output is the target's, whatever proposes.

Greedy: token-identical to the same engine without speculation and to transformers' generate,
with a draft model (equal to the target, unrelated, adversarial) and with prompt lookup, under
chunked prefill, preemption and prefix-cache hits. Sampling: the rejection sampler's tokens
follow the target's distribution (chi-square), and the test catches a broken acceptance rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_paged
from hf_paged import Engine, SamplingParams
from hf_paged.spec_decode import rejection_sampler
from hf_paged.spec_decode.ngram import propose_ngram
from hf_paged.spec_decode.policy import SpecPolicy

FIXED = dict(speculative_policy="fixed", num_speculative_tokens=3)


def _prompts(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _repetitive(n, period=5, start=10):
    return [start + i % period for i in range(n)]


def _outputs(engine, prompts, params):
    outs = engine.generate(prompts, params)
    engine.check_invariants()
    return [o.output_token_ids for o in outs], outs


def _reference(model, prompts, max_tokens, **options):
    engine = Engine(model, **options)
    try:
        return _outputs(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    finally:
        engine.shutdown()


def _negated(model):
    """A draft that proposes the target's least likely token: every first proposal wrong."""
    with torch.no_grad():
        model.get_output_embeddings().weight.neg_()
    return model


# -- prompt lookup ----------------------------------------------------------------------------


def test_ngram_proposals_match_transformers_prompt_lookup():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    rng = np.random.default_rng(0)
    for _ in range(200):
        length = int(rng.integers(2, 40))
        tokens = rng.integers(0, 5, length)
        n, k = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        ref = PromptLookupCandidateGenerator(
            num_output_tokens=k, max_matching_ngram_size=n, max_length=1000
        )
        candidates, _ = ref.get_candidates(torch.tensor(tokens)[None])
        assert propose_ngram(tokens, n, k) == candidates[0, length:].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_prompt_lookup_greedy_identical(arch, tiny_model):
    model = tiny_model(arch)
    prompts = _prompts([9, 40, 17]) + [_repetitive(30), _repetitive(50, period=7)]
    ref = _reference(model, prompts, 24)
    engine = Engine(model, **FIXED)
    params = SamplingParams(max_tokens=24, temperature=0, prompt_lookup_num_tokens=3)
    got, outs = _outputs(engine, prompts, params)
    assert got == ref
    assert sum(o.num_spec_proposed for o in outs) > 0
    assert engine.stats()["spec_num_accepted"] > 0  # the repetitive prompts are looked up
    engine.shutdown()


def test_prompt_lookup_through_generate_matches_transformers(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([12, 30, 5])
    ids[1, -20:] = torch.tensor(_repetitive(20))
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    hf_paged.patch(model, **FIXED)
    try:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=20,
            prompt_lookup_num_tokens=4,
        )
        engine = hf_paged.get_engine(model)
        assert engine.stats()["spec_num_proposed"] > 0
    finally:
        hf_paged.unpatch(model)
    assert torch.equal(out, ref)


# -- draft models ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target_arch,draft_arch", [("llama", "llama"), ("qwen2", "gemma2"), ("phi3", "olmo2")]
)
def test_draft_greedy_identical_mixed_lengths(target_arch, draft_arch, tiny_model):
    target = tiny_model(target_arch)
    prompts = _prompts([1, 9, 40, 17, 70])
    ref = _reference(target, prompts, 20)
    engine = Engine(target, draft_model=tiny_model(draft_arch, seed=3), **FIXED)
    got, _ = _outputs(engine, prompts, SamplingParams(max_tokens=20, temperature=0))
    assert got == ref
    assert engine.stats()["spec_num_proposed"] > 0
    engine.shutdown()


def test_verify_steps_in_the_small_batch_forward(tiny_model):
    # small_batch_rows above k + 1: a batch-1 verify step (k + 1 query tokens, k + 1 logits
    # rows kept) runs the fused small-batch forward (Triton interpreter here); same tokens
    target = tiny_model("llama")
    prompts = _prompts([9])
    opts = dict(attention_backend="triton", async_scheduling=False)
    ref = _reference(target, prompts, 8, small_batch_rows=0, **opts)
    engine = Engine(
        target, draft_model=tiny_model("llama", seed=3), small_batch_rows=8, **opts, **FIXED
    )
    fast = engine.runner.forward.small_batch
    assert fast is not None, engine.runner.forward.small_batch_status
    rows = []
    engine.runner.forward.small_batch = type(
        "Counting",
        (),
        {
            "max_rows": fast.max_rows,
            "__call__": lambda s, i, *a: rows.append(i.shape[0]) or fast(i, *a),
        },
    )()
    got, _ = _outputs(engine, prompts, SamplingParams(max_tokens=8, temperature=0))
    engine.shutdown()
    assert got == ref
    assert FIXED["num_speculative_tokens"] + 1 in rows  # verify steps ran fused


@pytest.mark.parametrize("k", [1, 5])  # the token buckets of 2 and of 8
def test_small_verify_steps_replay_a_small_mixed_graph_with_the_fused_forward(tiny_model, k):
    """With graphs, a batch-1 verify step (k + 1 tokens) is a mixed step: it replays the mixed
    graph of the smallest token bucket that holds it, and buckets up to small_batch_rows hold
    the fused small-batch forward (padded tokens write nothing, attend to nothing). The graph
    runner's padded buffers without capture (eager) on the CPU; same tokens as without."""
    from hf_paged.worker.cuda_graphs import CudaGraphRunner

    target = tiny_model("llama")
    prompts = _prompts([9])
    opts = dict(attention_backend="triton", async_scheduling=False)
    ref = _reference(target, prompts, 8, small_batch_rows=0, **opts)
    fixed = dict(FIXED, num_speculative_tokens=k)
    # a draft equal to the target: every proposal accepted, so a verify input read from the
    # wrong device entry would change the tokens
    engine = Engine(target, draft_model=tiny_model("llama"), small_batch_rows=8, **opts, **fixed)
    graphs = engine.runner.graphs = CudaGraphRunner(engine.runner, eager=True)
    assert graphs.token_buckets[:4] == [2, 4, 8, 32]
    _draft_graphs(engine)  # k = 5: the verify steps read d_1 .. d_5 on the device
    read_on_device = _device_reads(engine)
    fast = engine.runner.forward.small_batch
    rows = []
    engine.runner.forward.small_batch = type(
        "Counting",
        (),
        {
            "max_rows": fast.max_rows,
            "pdl": fast.pdl,
            "__call__": lambda s, i, *a: rows.append(a[0].shape[0]) or fast(i, *a),
        },
    )()
    got, _ = _outputs(engine, prompts, SamplingParams(max_tokens=8, temperature=0))
    assert engine.stats()["spec_num_verify_steps"] > 0
    assert engine.stats()["spec_acceptance_rate"] == 1.0
    engine.shutdown()
    assert got == ref
    assert graphs.replays["mixed"] > 0
    assert graphs.token_bucket_for(k + 1) in rows  # the verify steps' padded bucket, fused
    assert (5 in read_on_device) == (k == 5)  # (fewer proposals near the length limit)


@pytest.mark.parametrize(
    "lengths, budget",
    [([9], None), ([9, 30], None), ([9, 10], 8)],  # 8 tokens a step: one row's proposals cut
)
def test_draft_chain_replays_its_decode_graph(tiny_model, lengths, budget):
    """With graphs, a draft's proposals after its first decode step replay that step's graph
    with no host step between (model_runner.queue_decode_run). The graph runner without capture
    (eager) on the CPU: a draft equal to the target still accepts everything, and the tokens
    are those without speculation. The proposals are read only when the next step starts
    (DraftProposer.land): a row whose proposals the token budget cut gets the values too."""
    target = tiny_model("llama")
    prompts = _prompts(lengths)
    opts = dict(attention_backend="triton", block_size=8)
    if budget is not None:
        opts.update(max_num_batched_tokens=budget, enable_chunked_prefill=True)
    ref = _reference(target, prompts, 12, **opts)  # (Triton's interpreter: few tokens)
    engine = Engine(
        target, draft_model=tiny_model("llama"), **opts, **dict(FIXED, num_speculative_tokens=4)
    )
    runs = _draft_graphs(engine)
    spec, cuts = engine.runner.spec, []
    read_on_device = _device_reads(engine)
    land = spec.land

    def watch(scheduled):  # rows whose scheduled proposals are fewer than the draft made
        unread = spec.draft._unread
        made = {rid: len(p) for rid, p in unread[4].items()} if unread else {}
        land(scheduled)
        cuts.extend(r for r, p in (scheduled or {}).items() if len(p) < made.get(r, 0))

    spec.land = watch
    got, outs = _outputs(engine, prompts, SamplingParams(max_tokens=12, temperature=0))
    engine.shutdown()
    assert got == ref
    assert read_on_device and all(n > 0 for n in read_on_device)
    assert all(o.spec_acceptance_rate == 1.0 for o in outs)
    done = [r for r in runs if r is not None]
    # every chain: up to k = 4 proposals (fewer near the length limit), d_2 from its step and
    # the rest from the replays
    assert len(done) == len(runs) > 0 and all(2 <= r.shape[0] <= 3 for r in done)
    assert any(r.shape[0] == 3 for r in done)
    assert bool(cuts) == (budget is not None)


def test_draft_runs_from_its_catch_up_after_a_rejection(tiny_model):
    """After a verify step that rejected a proposal, the draft's catch-up is a decode step of a
    token a request (the target's token): its graph replay starts the run itself (the replay
    writes each row's drawn token into the graph's input ids, so a row fed from the host feeds
    the drawn token next). The proposals, step by step, equal those of the draft run without
    graphs, and the tokens those without speculation."""
    target = tiny_model("llama")
    prompts = _prompts([9, 30])
    opts = dict(attention_backend="triton", block_size=8)
    ref = _reference(target, prompts, 12, **opts)

    def run(draft_graphs):
        draft = tiny_model("llama")
        with torch.no_grad():  # a draft close to the target: some proposals rejected
            w = draft.get_output_embeddings().weight
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 0.3 * w.std())
        engine = Engine(target, draft_model=draft, **opts, **dict(FIXED, num_speculative_tokens=4))
        runs = _draft_graphs(engine) if draft_graphs else None
        spec, proposed = engine.runner.spec, []
        record = spec.record

        def watch(scheduled, accepted):
            proposed.append({r: list(scheduled[r]) for r in sorted(accepted)})
            record(scheduled, accepted)

        spec.record = watch
        got, _ = _outputs(engine, prompts, SamplingParams(max_tokens=12, temperature=0))
        rate = engine.stats()["spec_acceptance_rate"]
        engine.shutdown()
        return got, proposed, runs, rate

    got, proposed, runs, rate = run(True)
    plain_got, plain_proposed, _, _ = run(False)
    assert got == plain_got == ref
    assert proposed == plain_proposed and 0 < rate < 1
    # d_1 .. d_4 from a run replaying the catch-up's graph (4 rows), and runs from the first
    # decode step (3 rows) after the verify steps that accepted everything
    assert {r.shape[0] for r in runs if r is not None} == {3, 4}


def test_draft_equal_to_target_accepts_everything(tiny_model):
    target = tiny_model("llama")
    prompts = _prompts([9, 33, 17])
    ref = _reference(target, prompts, 21)
    engine = Engine(target, draft_model=tiny_model("llama"), **FIXED)
    got, outs = _outputs(engine, prompts, SamplingParams(max_tokens=21, temperature=0))
    assert got == ref
    for o in outs:
        assert o.num_spec_proposed > 0 and o.spec_acceptance_rate == 1.0
    stats = engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_mean_accepted_length"] > 3.5  # k = 3, less where few tokens are left
    engine.shutdown()


def test_adversarial_draft_still_identical(tiny_model):
    target = tiny_model("llama")
    prompts = _prompts([9, 33, 17, 4])
    ref = _reference(target, prompts, 16)
    engine = Engine(target, draft_model=_negated(tiny_model("llama")), **FIXED)
    got, outs = _outputs(engine, prompts, SamplingParams(max_tokens=16, temperature=0))
    assert got == ref
    assert all(o.num_spec_proposed > 0 and o.num_spec_accepted == 0 for o in outs)
    engine.shutdown()


def _device_reads(engine) -> list:
    """Watches the target's forwards: for each verify step launched before the host read the
    draft's proposals (they were queued on the device: step_inputs.DeviceProposals), how many
    of its input tokens it reads on the device."""
    runner, reads = engine.runner, []
    run_forward = runner._run_forward

    def forward(step, kept):
        if step.num_spec is not None and runner.spec.on_device() is not None:
            reads.append(int(step.pending.sum()))
        return run_forward(step, kept)

    runner._run_forward = forward
    return reads


def _draft_graphs(engine) -> list:
    """The draft's runner on the graph runner's padded buffers without capture (eager): its
    chains run as decode runs and their proposals are read when the next step starts. Returns
    what each decode_again call gave: a run's token tensor, or None (run step by step)."""
    from hf_paged.worker.cuda_graphs import CudaGraphRunner

    draft = engine.runner.spec.draft.runner
    graphs = draft.graphs = CudaGraphRunner(draft, eager=True)
    real, runs = graphs.decode_again, []

    def decode_again(step, n, out=None):
        runs.append(real(step, n, out))
        return runs[-1]

    graphs.decode_again = decode_again
    return runs


@pytest.mark.parametrize("draft_graphs", [False, True])
def test_draft_under_chunked_prefill_preemption_and_prefix_hits(tiny_model, draft_graphs):
    target = tiny_model("llama")
    shared = _prompts([48], seed=9)[0]
    prompts = [shared + p for p in _prompts([5, 20, 11, 30], seed=4)] + _prompts([60, 3])
    new_tokens = 24
    options = dict(max_num_batched_tokens=32, num_blocks=24, block_size=8)
    if draft_graphs:
        options["attention_backend"] = "triton"
        # every kernel in Triton's interpreter: fewer requests and tokens (~50 s, not ~180),
        # still preempted and hitting the prefix cache
        prompts, new_tokens = prompts[:3] + prompts[4:5], 12
    ref = _reference(target, prompts, new_tokens, **options)
    engine = Engine(target, draft_model=tiny_model("llama", seed=1), **FIXED, **options)
    runs = _draft_graphs(engine) if draft_graphs else None
    got, _ = _outputs(engine, prompts, SamplingParams(max_tokens=new_tokens, temperature=0))
    stats = engine.stats()
    engine.shutdown()
    assert got == ref
    assert runs is None or any(r is not None for r in runs)
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    assert stats["spec_num_proposed"] > 0, stats


def test_draft_with_assistant_model_in_generate(tiny_model, batch_factory):
    target, draft = tiny_model("llama"), tiny_model("llama")
    ids, mask = batch_factory([12, 30, 5])
    ref = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    hf_paged.patch(target, draft_model=draft, **FIXED)
    try:
        out = target.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=16,
            assistant_model=draft,
        )
        assert hf_paged.get_engine(target).stats()["spec_acceptance_rate"] == 1.0
        with pytest.raises(ValueError, match="assistant_model"):
            target.generate(input_ids=ids, assistant_model=tiny_model("llama"))
        with pytest.raises(ValueError, match="beam"):
            target.generate(input_ids=ids, num_beams=2, assistant_model=draft)
        with pytest.raises(ValueError, match="num_assistant_tokens"):  # k is the engine's
            target.generate(input_ids=ids, assistant_model=draft, num_assistant_tokens=7)
    finally:
        hf_paged.unpatch(target)
    assert torch.equal(out, ref)
    # the draft goes back as it came: its own attention, unfused projections
    assert draft.config._attn_implementation != "hf_paged"


def test_stops_inside_an_accepted_run_cut_it(tiny_model):
    target = tiny_model("llama")
    prompts = _prompts([9, 33])
    ref = _reference(target, prompts, 20)
    stop = ref[0][5]  # the 6th token of the first prompt ends it (as a stop id)
    engine = Engine(target, draft_model=tiny_model("llama"), **FIXED)
    params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop])
    got, _ = _outputs(engine, prompts, params)
    for r, g in zip(ref, got):
        end = r.index(stop) + 1 if stop in r else len(r)
        assert g == r[:end]
    got, _ = _outputs(engine, prompts, SamplingParams(max_tokens=7, temperature=0))
    assert got == [r[:7] for r in ref]  # the length limit inside a run
    engine.shutdown()


def test_stop_string_inside_an_accepted_run(tiny_model):
    from hf_paged.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    target = tiny_model("llama")
    prompts = _prompts([9, 33])
    ref = _reference(target, prompts, 20)
    text = tok.decode(ref[0][4:6])  # a stop string the first request meets at its 6th token
    engine = Engine(target, tok, draft_model=tiny_model("llama"), **FIXED)
    plain = Engine(target, tok)
    params = SamplingParams(max_tokens=20, temperature=0, stop_strings=[text])
    got, _ = _outputs(engine, prompts, params)
    expected, _ = _outputs(plain, prompts, params)
    engine.shutdown()
    plain.shutdown()
    assert got == expected and len(got[0]) <= 6


@pytest.mark.parametrize("draft_graphs", [False, True])
def test_aborts_and_history_options_leave_no_blocks(tiny_model, draft_graphs):
    target = tiny_model("llama")
    backend = {"attention_backend": "triton"} if draft_graphs else {}
    engine = Engine(target, draft_model=tiny_model("llama"), **FIXED, **backend)
    runs = _draft_graphs(engine) if draft_graphs else None
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=30, temperature=0))
        for p in _prompts([5, 9, 14])
    ]
    # a request whose sampling reads its history decodes one token a step beside the others
    penalised = engine.add_request(
        _prompts([7])[0], SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3)
    )
    for _ in range(3):
        engine.step()
    engine.abort(ids[1])
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    engine.check_invariants()
    assert engine.kv.get_num_free_blocks() == engine.kv.num_blocks
    assert outs[penalised].num_spec_proposed == 0 and outs[ids[0]].num_spec_proposed > 0
    assert runs is None or any(r is not None for r in runs)
    engine.shutdown()


# -- sampling: the rejection sampler draws from the target's distribution ---------------------


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic over tokens with an expected count of at least 5 (the rest pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum() - 1)


def _critical(dof: int) -> float:
    """A chi-square critical value at about p = 0.001 (Wilson-Hilferty); one category: 0."""
    if dof < 1:
        return 1e-9
    z = 3.09
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def _rows(params, n):
    from hf_paged.sample.metadata import SamplingRow

    row = SamplingRow("r", params, None, [1, 2, 3], 3)
    return [row] * n


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=6),
    ],
)
def test_rejection_sampling_matches_target_distribution(params):
    torch.manual_seed(0)
    vocab, n = 12, 20000
    logits = torch.randn(3, vocab) * 1.5  # the target's rows at the last token, d1, d2
    from hf_paged.sample.logits_processing import apply_warpers

    warped = apply_warpers(logits.clone(), _rows(params, 3), [0, 1, 2])
    p = warped.softmax(-1).numpy()
    proposals = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # likely, and less likely
    out = rejection_sampler.verify(logits.repeat(n, 1), _rows(params, n), [proposals] * n)
    first = np.bincount([o[0] for o in out], minlength=vocab)
    assert first[p[0] == 0].sum() == 0  # nothing the warpers removed
    stat, dof = _chi_square(first, p[0])
    assert stat < _critical(dof), (stat, dof)
    second = np.bincount([o[1] for o in out if o[0] == proposals[0]], minlength=vocab)
    assert second.sum() > 500 and second[p[1] == 0].sum() == 0  # given d1 was accepted
    stat, dof = _chi_square(second, p[1])
    assert stat < _critical(dof), (stat, dof)


def test_broken_acceptance_rule_is_caught(monkeypatch):
    torch.manual_seed(0)
    vocab, n = 12, 20000
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=1.0)
    real = rejection_sampler._uniforms
    # accept with min(1, 2 p(d)) instead of p(d): proposals win too often
    monkeypatch.setattr(rejection_sampler, "_uniforms", lambda *a: [u / 2 for u in real(*a)])
    out = rejection_sampler.verify(logits.repeat(n, 1), _rows(params, n), [[3, 7]] * n)
    first = np.bincount([o[0] for o in out], minlength=vocab)
    stat, dof = _chi_square(first, logits[0].softmax(-1).numpy())
    assert stat > _critical(dof)


def test_engine_sampling_distribution_unchanged_by_speculation(tiny_model):
    """The third generated token's distribution over many requests, with a draft equal to the
    target (most tokens come from accepted proposals) and without: a two-sample chi-square."""
    target = tiny_model("llama")
    prompt = _prompts([6], seed=2)[0]
    params = SamplingParams(max_tokens=4, temperature=0.4, ignore_eos=True)
    n = 1200

    def third_tokens(**options):
        engine = Engine(target, **options)
        outs = engine.generate([prompt] * n, params)
        stats = engine.stats()
        engine.shutdown()
        return np.bincount([o.output_token_ids[2] for o in outs], minlength=256), stats

    plain, _ = third_tokens()
    spec, stats = third_tokens(draft_model=tiny_model("llama"), **FIXED)
    assert stats["spec_num_accepted"] > n / 4, stats  # many tokens were accepted proposals
    both = plain + spec
    keep = both >= 10
    a = np.append(plain[keep], plain[~keep].sum())
    b = np.append(spec[keep], spec[~keep].sum())
    total = a + b
    exp_a, exp_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    ok = total > 0
    stat = (((a - exp_a) ** 2 / exp_a)[ok] + ((b - exp_b) ** 2 / exp_b)[ok]).sum()
    assert stat < _critical(int(ok.sum()) - 1), stat


# -- options and refusals ----------------------------------------------------------------------


def test_bad_speculation_options_are_refused(tiny_model):
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(target, num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_policy"):
        Engine(target, speculative_policy="always")
    with pytest.raises(ValueError, match="draft_model"):
        Engine(target, draft_model="tiny-llama")
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(target, draft_model=tiny_model("llama", vocab_size=300))
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        SamplingParams(prompt_lookup_num_tokens=-1)
    engine = Engine(target, draft_model=tiny_model("llama"))
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        engine.add_request([5, 6, 7], SamplingParams(prompt_lookup_num_tokens=2))
    engine.check_invariants()
    engine.shutdown()


def test_policy_model_speculates_at_small_batches_only():
    policy = SpecPolicy(5, draft_ratio=0.14, bytes_per_param=2)
    assert policy.best_k(1, 0.8) >= 3
    assert policy.best_k(1024, 0.95) == 0
    assert policy.plan(1024) == 0 and not policy.buckets  # never tried where it cannot pay
    assert policy.best_k(1, 0.05) == 0
    # acceptance per position: 2 requests proposed 4 each, one kept 3 then was rejected, the
    # other kept all 4: 7 accepted, 1 rejection -> 7/8 per position (7/8 of proposals, too)
    policy.acceptance = 0.5
    for _ in range(40):
        policy.record(8, 7, 2, 1)
    assert abs(policy.acceptance - 7 / 8) < 0.01
    for _ in range(400):  # 3 proposals, the first rejected: nothing after it was looked at
        policy.record(3, 0, 1, 1)
    assert policy.acceptance < 0.01


def test_policy_measures_and_keeps_the_faster_mode():
    policy = SpecPolicy(4, draft_ratio=0.1, bytes_per_param=2, explore_every=20)
    modes = []
    for _ in range(200):
        k = policy.plan(8)
        modes.append(k > 0)
        # speculating steps run at 100 tok/s, plain ones at 150: speculation loses here
        policy.observe(8, 1.0, 100 if k else 150, speculated=k > 0)
    assert modes[0]  # the model's first pick at batch 8 is to speculate
    assert not all(modes[:12])  # both modes measured (the first step after a switch is not)
    later = modes[12:]
    trial = SpecPolicy.TRIAL_STEPS
    assert sum(later) <= len(later) // 20 * trial + trial  # then off, with short trials
    assert any(later)  # the trials happen


def test_draft_with_a_smaller_vocabulary(tiny_model):
    """Target tokens past the draft's vocabulary reach the draft as token 0."""
    target = tiny_model("llama")
    prompts = _prompts([9, 33, 17])  # ids up to 255: some past the draft's 200
    ref = _reference(target, prompts, 16)
    engine = Engine(target, draft_model=tiny_model("llama", vocab_size=200), **FIXED)
    got, _ = _outputs(engine, prompts, SamplingParams(max_tokens=16, temperature=0))
    engine.shutdown()
    assert got == ref
