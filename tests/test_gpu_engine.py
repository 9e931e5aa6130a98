"""Ladder step 4 (GPU only): the engine at real head shapes.

TinyLlama-1.1B attention/MLP shapes (hidden 2048, 32 q heads, 4 kv heads, head 64) with fewer
layers, random weights. Identity checks run in float32, where two correct implementations agree
to ~1e-6 and greedy tokens must match exactly; bf16 runs must agree on every row's first token.

Three groups of under 5 minutes each on the H200 (README, Test): the tests marked `graphs`
(graph capture and torch.compile at every scope), those marked `small_batch` (the small-batch
forward and in-graph greedy tokens), and the rest.
"""

from __future__ import annotations

import pytest
import torch

import hf_paged

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def _model(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(dtype).eval()
    with torch.no_grad():  # separate greedy choices (random logits are near-uniform)
        model.lm_head.weight.mul_(8.0)
    return model


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.zeros((len(lengths), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, longest - n :] = torch.randint(3, 32000, (n,), generator=g)
        mask[i, longest - n :] = 1
    return ids.cuda(), mask.cuda()


LENGTHS = [1, 17, 64, 100, 257, 500, 33, 1000] * 2
# every speed option off: the reference the options are compared against
PLAIN = dict(compile=False, cuda_graphs=False, async_scheduling=False, fuse_projections=False)


def _generate(model, ids, mask, new=48, **options):
    hf_paged.patch(model, **options)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new)
        hf_paged.get_engine(model).check_invariants()
        return out
    finally:
        hf_paged.unpatch(model)


def test_triton_backend_matches_transformers_fp32():
    model = _model(torch.float32)
    ids, mask = _batch(LENGTHS)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    out = _generate(model, ids, mask, attention_backend="triton", **PLAIN)
    assert torch.equal(out, ref)
    defaults = _generate(model, ids, mask)  # compile (layers), graphs, async, fused projections
    assert torch.equal(defaults, ref)


@pytest.mark.graphs
def test_graph_replay_and_compile_change_no_greedy_output_fp32():
    model = _model(torch.float32)
    ids, mask = _batch(LENGTHS, seed=1)
    eager = _generate(model, ids, mask, **PLAIN)
    graphs = _generate(model, ids, mask, **{**PLAIN, "cuda_graphs": True})
    compiled = {**PLAIN, "compile": True, "cuda_graphs": True}
    both = _generate(model, ids, mask, **compiled, compile_scope="model")
    layers = _generate(model, ids, mask, **compiled, compile_scope="layers")
    assert torch.equal(graphs, eager)
    assert torch.equal(both, eager)
    assert torch.equal(layers, eager)


def test_async_scheduling_changes_no_greedy_output_fp32():
    # decode inputs read on the device (graph and eager paths), stops one step late
    model = _model(torch.float32)
    ids, mask = _batch(LENGTHS, seed=3)
    # a 512-token budget: prefill chunks share steps with decodes whose input is still pending
    sync = _generate(model, ids, mask, max_num_batched_tokens=512, **PLAIN)
    for opts in (dict(cuda_graphs=True), dict(cuda_graphs=False)):
        opts = {**PLAIN, **opts, "async_scheduling": True}
        out = _generate(model, ids, mask, max_num_batched_tokens=512, **opts)
        assert torch.equal(out, sync), opts


def test_fused_projections_change_no_greedy_output_fp32():
    model = _model(torch.float32)
    ids, mask = _batch(LENGTHS, seed=4)
    plain = _generate(model, ids, mask, **PLAIN)
    for opts in (dict(cuda_graphs=True), dict(compile=True, cuda_graphs=True)):
        out = _generate(model, ids, mask, **{**PLAIN, **opts, "fuse_projections": True})
        assert torch.equal(out, plain), opts


def test_graphs_used_for_decode_steps():
    model = _model(torch.bfloat16)
    ids, mask = _batch([5, 9, 30], seed=2)
    hf_paged.patch(model, **{**PLAIN, "cuda_graphs": True}, max_num_seqs=64)
    try:
        engine = hf_paged.get_engine(model)
        assert engine.runner.graphs is not None
        assert engine.runner.graphs.buckets[:4] == [1, 2, 4, 8]
        calls = []
        real_run = engine.runner.graphs.run
        engine.runner.graphs.run = lambda step: calls.append(len(step.rows)) or real_run(step)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8)
        assert calls and all(c == 3 for c in calls)  # every decode step replayed a graph
    finally:
        hf_paged.unpatch(model)


@pytest.mark.graphs
def test_mixed_step_graphs_change_no_greedy_output_fp32():
    # a 512-token budget: prompt chunks share steps with decodes, and every such step fits a
    # token bucket, so it replays a captured mixed-step graph (padded tokens and sequences)
    model = _model(torch.float32)
    ids, mask = _batch(LENGTHS, seed=5)
    budget = dict(max_num_batched_tokens=512)
    eager = _generate(model, ids, mask, **budget, **PLAIN)
    for opts in (dict(cuda_graphs=True), dict(compile=True, cuda_graphs=True), {}):
        opts = {**budget, **PLAIN, **opts} if opts else budget  # {}: every default on
        hf_paged.patch(model, **opts)
        try:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48)
            engine = hf_paged.get_engine(model)
            engine.check_invariants()
            replays = dict(engine.runner.graphs.replays)
        finally:
            hf_paged.unpatch(model)
        assert torch.equal(out, eager), opts
        assert replays["mixed"] > 0 and replays["decode"] > 0, (opts, replays)


@pytest.mark.small_batch
def test_small_batch_forward_changes_no_greedy_output_fp32():
    # steps of <= 8 tokens through hf_paged/worker/small_batch_forward.py (fused GEMVs, RoPE + KV
    # write, PDL): eager, graphs, graphs + compile, every default, PDL off; batch 6 and batch 1
    model = _model(torch.float32)
    for lengths, seed in (([5, 17, 40, 9, 100, 33], 6), ([300], 7)):
        ids, mask = _batch(lengths, seed=seed)
        plain = _generate(model, ids, mask, **PLAIN)
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
        assert torch.equal(plain, ref)
        fused = {**PLAIN, "fuse_projections": True, "small_batch_rows": 8}
        for opts in (
            fused,
            {**fused, "cuda_graphs": True},
            {**fused, "cuda_graphs": True, "compile": True},
            {"small_batch_rows": 8},  # every other default
            {},
        ):
            hf_paged.patch(model, **opts)
            try:
                assert hf_paged.get_engine(model).runner.forward.small_batch is not None
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48)
            finally:
                hf_paged.unpatch(model)
            assert torch.equal(out, plain), (lengths, opts)


@pytest.mark.small_batch
@pytest.mark.parametrize("lengths", [[300], [5, 40, 17]])  # batch 1; batch 3 padded to 4
def test_in_graph_greedy_tokens_change_no_greedy_output_fp32(lengths):
    # All-greedy decode steps take their tokens from the decode graph (argmax + last_tokens
    # write inside it, hf_paged/worker/cuda_graphs.py), not from the sampler: graphs on against
    # graphs off, synchronous and asynchronous (the next input read from last_tokens), through the
    # small-batch forward (batch 1: the argmax launched with PDL) and transformers' forward
    # (the padded batch of 3, or small_batch_rows=0)
    from hf_paged.sample.sampler import Sampler

    model = _model(torch.float32)
    ids, mask = _batch(lengths, seed=8)
    plain = _generate(model, ids, mask, **PLAIN)
    graphs_on = {**PLAIN, "cuda_graphs": True}
    for opts in (
        graphs_on,
        {**graphs_on, "async_scheduling": True},
        {"small_batch_rows": 0, "compile": False},  # transformers' forward (compile: below)
        {},  # every default: compile, async, fused projections, small-batch forward
    ):
        hf_paged.patch(model, **opts)
        try:
            runner = hf_paged.get_engine(model).runner
            graphs = runner.graphs
            assert graphs.greedy_in_graph
            calls = {"decode": 0, "sampler after decode": 0}
            real_run, last = graphs.run, {"decode": False}

            def run(step, real_run=real_run, calls=calls, last=last):
                calls["decode"] += 1
                last["decode"] = True
                return real_run(step)

            class Counting(Sampler):
                def __call__(self, logits, rows, pool=None, calls=calls, last=last, **options):
                    calls["sampler after decode"] += last["decode"]
                    return Sampler.__call__(self, logits, rows, pool, **options)

            def execute(*args, real_execute=runner.execute, last=last, **kwargs):
                last["decode"] = False  # set by this step's decode replay, if any
                return real_execute(*args, **kwargs)

            counting = Counting(runner.device)
            counting.__dict__.update(runner.sampler.__dict__)
            runner.sampler, graphs.run, runner.execute = counting, run, execute
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48)
            hf_paged.get_engine(model).check_invariants()
        finally:
            hf_paged.unpatch(model)
        assert torch.equal(out, plain), (lengths, opts)
        assert calls["decode"] > 0 and calls["sampler after decode"] == 0, (opts, calls)


def test_bf16_agreement_with_transformers_and_torch_backend():
    model = _model(torch.bfloat16)
    ids, mask = _batch(LENGTHS, seed=3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=False)
    tri = _generate(model, ids, mask)
    torch_b = _generate(model, ids, mask, attention_backend="torch", compile=False)
    new = slice(ids.shape[1], None)
    rate_hf = (tri[:, new] == ref[:, new]).all(dim=1).float().mean().item()
    rate_torch = (tri[:, new] == torch_b[:, new]).all(dim=1).float().mean().item()
    print(
        f"bf16 identical sequences: vs transformers {rate_hf:.0%}, "
        f"vs torch backend {rate_torch:.0%}"
    )
    # Random bf16 weights leave near-tied logits, and one flipped token changes the rest of the
    # row: measured on the H200 (4 layers, 16 rows x 48 tokens) 25% identical rows vs
    # transformers and 19% vs the torch backend, while the fp32 tests are exact. A systematic
    # bug shows at the first new token, so that is what is asserted, against both.
    first = ids.shape[1]
    assert (tri[:, first] == ref[:, first]).float().mean().item() >= 0.9
    assert (tri[:, first] == torch_b[:, first]).float().mean().item() >= 0.9
    assert rate_hf > 0 and rate_torch > 0  # some rows agree over all 48 tokens


def test_cuda_kv_cache_sized_from_memory():
    model = _model(torch.bfloat16)
    hf_paged.patch(model, gpu_memory_utilization=0.5, cuda_graphs=False, compile=False)
    try:
        engine = hf_paged.get_engine(model)
        free, total = torch.cuda.mem_get_info()
        kv_bytes = engine.runner.kv_spec.bytes_per_block * engine.kv.num_blocks
        assert engine.kv.num_blocks > 1000
        assert torch.cuda.memory_allocated() <= 0.5 * total * 1.02
        assert kv_bytes > 0.2 * total
    finally:
        hf_paged.unpatch(model)


def test_lora_adapters_per_row_match_peft_alone_fp32():
    # a PeftModel with two adapters on the real head shapes: a mixed batch (two adapters and the
    # base) through the engine gives each row peft's own greedy tokens with that adapter alone
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _model(torch.float32), LoraConfig(r=16, target_modules=["q_proj", "v_proj"]), "math"
    )
    model.add_adapter("chat", LoraConfig(r=8, target_modules=["o_proj", "down_proj", "up_proj"]))
    torch.manual_seed(1)
    for module in model.modules():
        for lin in getattr(module, "lora_B", {}).values():
            torch.nn.init.normal_(lin.weight, std=0.05)
    model.eval()
    lengths, names = [40, 17, 100], ["math", "__base__", "chat"]
    ids, mask = _batch(lengths, seed=9)
    want = []
    for i, name in enumerate(names):
        row = ids[i : i + 1, -lengths[i] :]
        if name == "__base__":
            with model.disable_adapter():
                out = model.generate(input_ids=row, max_new_tokens=24, do_sample=False)
        else:
            model.set_adapter(name)
            out = model.generate(input_ids=row, max_new_tokens=24, do_sample=False)
        want.append(out[0, lengths[i] :].tolist())
    hf_paged.patch(model)
    try:
        got = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=24, adapter_names=names
        )
    finally:
        hf_paged.unpatch(model)
    assert got[:, ids.shape[1] :].tolist() == want


@pytest.mark.graphs
@pytest.mark.parametrize("small_batch_rows", [2, 8])
def test_speculative_decoding_with_graphs_and_compile_fp32(small_batch_rows):
    """A draft equal to the target through every fast path (compile, decode and mixed-step
    graphs for the verify steps and the draft's steps, the small-batch forward at batch 1):
    the same greedy tokens as without speculation, every proposal accepted, no block left.
    small_batch_rows=8: batch-1 verify steps (k + 1 <= 8 tokens) replay the small mixed-step
    graphs that hold the fused small-batch forward."""
    model, draft = _model(torch.float32), _model(torch.float32)
    for lengths in ([5, 40, 17, 300], [60]):
        ids, mask = _batch(lengths, seed=7)
        ref = _generate(model, ids, mask, new=40)
        hf_paged.patch(
            model, draft_model=draft, speculative_policy="fixed", max_num_seqs=32,
            small_batch_rows=small_batch_rows,
        )  # fmt: skip
        try:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40)
            engine = hf_paged.get_engine(model)
            engine.check_invariants()
            stats = engine.stats()
            replays = dict(engine.runner.graphs.replays)
        finally:
            hf_paged.unpatch(model)
        assert torch.equal(out, ref), lengths
        assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_num_proposed"] > 0, stats
        assert replays["mixed"] > 0, replays  # verify steps replayed mixed-step graphs


@pytest.mark.graphs
@pytest.mark.parametrize(
    "opts",
    [
        dict(temperature=0.7, top_k=50, top_p=0.9),
        dict(temperature=1.1, top_p=0.8, min_p=0.02),
        # penalties inside the sampling graph, from device-resident counts
        dict(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.3),
        dict(temperature=1.1, top_p=0.8, presence_penalty=0.6, frequency_penalty=0.4),
    ],
    ids=["top-k list", "search", "top-k list + repetition", "search + presence/frequency"],
)
def test_sampling_graphs_change_no_seeded_output_fp32(opts):
    # Decode steps whose rows all sample in the kernels draw in captured sampling graphs
    # (hf_paged/worker/decode_sampling.py): seeded requests give the tokens of graphs off, the
    # graphs were captured and replayed, and unseeded runs repeat under torch.manual_seed
    from hf_paged import Engine, SamplingParams

    model = _model(torch.float32)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (5, 40, 17, 300)]
    seeded = [
        SamplingParams(max_tokens=m, seed=7 + i, ignore_eos=True, **opts)
        for i, m in enumerate((40, 12, 40, 40))  # one ends early: the rows change mid-run
    ]
    outs = {}
    for name, engine_opts in (
        ("plain", PLAIN),
        ("graphs", {**PLAIN, "cuda_graphs": True}),
        ("defaults", {}),
    ):
        eng = Engine(model, **engine_opts)
        try:
            outs[name] = [o.output_token_ids for o in eng.generate(prompts, seeded)]
            if name != "plain":
                sampling = eng.runner.graphs.sampling
                assert sampling.captured and sampling.replays >= 30, name
                penalised = [k for k in sampling.captured if k[2] is not None]
                assert bool(penalised) == ("penalty" in str(opts)), (name, list(sampling.captured))
                unseeded = SamplingParams(max_tokens=24, ignore_eos=True, **opts)
                runs = []
                for seed in (0, 0):
                    torch.manual_seed(seed)
                    runs.append([o.output_token_ids for o in eng.generate(prompts, unseeded)])
                assert runs[0] == runs[1], name
            eng.check_invariants()
        finally:
            eng.shutdown()
    assert outs["graphs"] == outs["plain"] and outs["defaults"] == outs["plain"]


@pytest.mark.graphs
def test_penalised_sampling_graphs_follow_a_growing_pool_fp32():
    # 24 penalised requests admitted over several steps: the penalty pool grows (8, 16, 32 rows)
    # while decode steps draw in captured sampling graphs, which are captured again on the new
    # tensors; seeded tokens equal the engine without graphs
    from hf_paged import Engine, SamplingParams

    model = _model(torch.float32)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in range(40, 520, 20)]
    seeded = [
        SamplingParams(
            max_tokens=24, seed=i, ignore_eos=True, temperature=0.8, top_k=40,
            repetition_penalty=1.2, frequency_penalty=0.3,
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    outs = {}
    for name, engine_opts in (("plain", PLAIN), ("defaults", {"max_num_batched_tokens": 1024})):
        eng = Engine(model, **engine_opts)
        try:
            outs[name] = [o.output_token_ids for o in eng.generate(prompts, seeded)]
            if name != "plain":
                sampling = eng.runner.graphs.sampling
                assert sampling.replays >= 10 and eng.runner.input_batch.penalty_counts.owners
            eng.check_invariants()
        finally:
            eng.shutdown()
    assert outs["defaults"] == outs["plain"]
