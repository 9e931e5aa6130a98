"""Sampling options: distributions against transformers' warpers, seeds, n > 1 siblings."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

import hf_paged
from hf_paged import Engine, SamplingParams
from hf_paged.sample.metadata import SamplingRow
from hf_paged.sample.sampler import Sampler

VOCAB = 24

WARPERS = {
    "temperature": (dict(temperature=0.6), [TemperatureLogitsWarper(0.6)]),
    "top_k": (dict(top_k=6), [TopKLogitsWarper(6)]),
    "top_p": (dict(top_p=0.8), [TopPLogitsWarper(0.8)]),
    "min_p": (dict(min_p=0.1), [MinPLogitsWarper(0.1)]),
    "typical_p": (dict(typical_p=0.7), [TypicalLogitsWarper(0.7)]),
    "all": (
        dict(temperature=1.4, top_k=15, top_p=0.95, min_p=0.02, typical_p=0.9),
        [
            TemperatureLogitsWarper(1.4),
            TopKLogitsWarper(15),
            TopPLogitsWarper(0.95),
            MinPLogitsWarper(0.02),
            TypicalLogitsWarper(0.9),
        ],
    ),
}


def _req(params: SamplingParams, req_id: str = "r") -> SamplingRow:
    return SamplingRow(req_id, params, None, [3], 1)


@pytest.mark.parametrize("name", list(WARPERS))
def test_draws_follow_transformers_warpers(name):
    """Chi-square over 20k draws against the distribution transformers' warpers define, and the
    processed scores equal the warpers' output."""
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB) * 2.5
    kwargs, warpers = WARPERS[name]
    params = SamplingParams(**kwargs)
    expected_scores = LogitsProcessorList(warpers)(None, logits.clone())
    expected = expected_scores.softmax(-1)[0]
    n = 20_000
    sampler = Sampler(torch.device("cpu"))
    reqs = [_req(params) for _ in range(n)]
    draws = sampler(logits.expand(n, -1).contiguous(), reqs).tokens
    counts = torch.bincount(draws, minlength=VOCAB).float()
    assert counts[expected == 0].sum() == 0  # never a filtered token
    keep = expected > 0
    chi2 = (((counts[keep] - n * expected[keep]) ** 2) / (n * expected[keep])).sum().item()
    dof = max(int(keep.sum()) - 1, 1)
    assert chi2 < dof + 5 * (2 * dof) ** 0.5  # ~5 sigma; a wrong distribution gives hundreds
    # processed scores (what output_scores returns) are transformers' own
    kept = _req(SamplingParams(**kwargs, output_scores=True), "k")
    out = sampler(logits.clone(), [kept])
    torch.testing.assert_close(out.scores["k"], expected_scores[0])


def test_mixed_rows_get_their_own_warpers():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB) * 2
    rows = [
        dict(temperature=0),
        dict(top_k=3),
        dict(min_p=0.3, temperature=0.5),
        dict(typical_p=0.5),
    ]
    reqs = [_req(SamplingParams(**kw, output_scores=True), str(i)) for i, kw in enumerate(rows)]
    out = Sampler(torch.device("cpu"))(logits.clone(), reqs)
    refs = [
        logits[0],
        TopKLogitsWarper(3)(None, logits[1:2].clone())[0],
        MinPLogitsWarper(0.3)(None, TemperatureLogitsWarper(0.5)(None, logits[2:3].clone()))[0],
        TypicalLogitsWarper(0.5)(None, logits[3:4].clone())[0],
    ]
    for r, ref in zip(reqs, refs):
        torch.testing.assert_close(out.scores[r.req_id], ref)


def test_seeded_requests_reproduce_across_batches(tiny_model):
    engine = Engine(tiny_model("llama"))
    prompt = [7, 8, 9, 10]
    params = SamplingParams(
        max_tokens=12, temperature=0.9, min_p=0.05, typical_p=0.95, repetition_penalty=1.1, seed=42
    )
    alone = engine.generate([prompt], params)[0].output_token_ids
    mixed = engine.generate(
        [[3, 4], prompt, [5] * 30], [SamplingParams(max_tokens=5), params, SamplingParams(seed=1)]
    )
    assert mixed[1].output_token_ids == alone
    other = SamplingParams(
        max_tokens=12, temperature=0.9, min_p=0.05, typical_p=0.95, repetition_penalty=1.1, seed=43
    )
    assert engine.generate([prompt], other)[0].output_token_ids != alone


def test_n_siblings_share_prompt_blocks_and_differ(tiny_model):
    # prefix caching off: the sharing below comes from forking, not from the prefix cache
    engine = Engine(tiny_model("llama"), block_size=16, enable_prefix_caching=False)
    prompt = list(range(3, 43))  # 40 tokens: 2 full blocks + a partial one
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7)
    rid = engine.add_request(prompt, params)
    ids = [rid] + [f"{rid}#{k}" for k in range(1, 4)]
    first = engine.step()  # the prompt once, then 4 first tokens from the same logits row
    assert sorted(o.request_id for o in first) == sorted(ids)
    assert sorted(o.index for o in first) == [0, 1, 2, 3]
    tables = [engine.kv.get_block_ids(r) for r in ids]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3  # all shared, refcount 4
    assert all(b.ref_cnt == 4 for b in engine.kv.req_to_blocks[rid])
    engine.step()  # every sibling writes into the partial block: copied on write
    tables = [engine.kv.get_block_ids(r) for r in ids]
    assert all(t[:2] == tables[0][:2] for t in tables)  # full prompt blocks still shared
    assert len({t[2] for t in tables}) == 4
    assert engine.kv.num_blocks - engine.kv.get_num_free_blocks() == 2 + 4
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()
    again = engine.generate([prompt], params)
    seqs = [o.output_token_ids for o in again]
    assert len({tuple(s) for s in seqs}) == 4  # siblings differ under sampling
    assert [o.index for o in again] == [0, 1, 2, 3]
    assert engine.generate([prompt], params)[0].output_token_ids == seqs[0]  # seeded


def test_n_siblings_greedy_kv_is_correct(tiny_model):
    """Greedy siblings must all equal the single greedy answer: forked KV (and the copied partial
    block) is exactly the parent's."""
    model = tiny_model("qwen2")
    engine = Engine(model, block_size=8, enable_prefix_caching=False)
    prompt = list(range(10, 31))  # 21 tokens: partial last block
    single = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    outs = engine.generate([prompt], SamplingParams(n=3, max_tokens=12, temperature=0))
    assert all(o.output_token_ids == single.output_token_ids for o in outs)


def test_num_return_sequences_in_generate(tiny_model, batch_factory):
    model = tiny_model("llama")
    ids, mask = batch_factory([5, 9], seed=3)
    hf_paged.patch(model)
    try:
        torch.manual_seed(0)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=6,
            num_return_sequences=3,
            return_dict_in_generate=True,
            output_scores=True,
        )
        assert out.sequences.shape == (6, ids.shape[1] + 6)
        assert torch.equal(out.sequences[:, : ids.shape[1]], ids.repeat_interleave(3, dim=0))
        assert len(out.scores) == 6 and out.scores[0].shape == (6, 256)
        assert len({tuple(r.tolist()) for r in out.sequences[:3]}) == 3
        with pytest.raises(ValueError, match="num_return_sequences"):
            model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=2)
    finally:
        hf_paged.unpatch(model)


def test_abort_parent_before_fork_aborts_siblings(tiny_model):
    engine = Engine(tiny_model("llama"), max_num_batched_tokens=16)
    rid = engine.add_request(list(range(3, 60)), SamplingParams(n=3, max_tokens=4))
    engine.step()  # a chunk of the prompt: siblings still pending
    assert f"{rid}#2" in engine.scheduler.requests
    engine.abort(f"{rid}#2")
    engine.abort(rid)
    # nothing left to run; the next step reports the three final outputs
    assert not engine.scheduler.has_unfinished_requests()
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [
        (rid, "abort"),
        (f"{rid}#1", "abort"),
        (f"{rid}#2", "abort"),
    ]
    assert not engine.has_unfinished_requests()
    engine.check_invariants()


def test_kernel_path_seeds_and_global_generator(tiny_model):
    """Rows the sampling kernel takes (temperature/top-k/top-p/min-p, here with a penalty): a
    seed repeats in any batch; rows without one follow torch's global generator."""
    engine = Engine(tiny_model("llama"))
    prompt = [7, 8, 9, 10]
    opts = dict(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02)
    params = SamplingParams(**opts, repetition_penalty=1.1, seed=42)
    alone = engine.generate([prompt], params)[0].output_token_ids
    mixed = engine.generate(
        [[3, 4], prompt, [5] * 30], [SamplingParams(max_tokens=5), params, SamplingParams(seed=1)]
    )
    assert mixed[1].output_token_ids == alone
    other = SamplingParams(**opts, repetition_penalty=1.1, seed=43)
    assert engine.generate([prompt], other)[0].output_token_ids != alone
    unseeded = SamplingParams(**opts)
    torch.manual_seed(0)
    first = [o.output_token_ids for o in engine.generate([prompt, [3, 4]], unseeded)]
    torch.manual_seed(0)
    assert [o.output_token_ids for o in engine.generate([prompt, [3, 4]], unseeded)] == first
    engine.check_invariants()
