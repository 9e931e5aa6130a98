"""Engine steps of <= small_batch_rows tokens run hf_paged/worker/small_batch_forward.py (fused
Triton GEMVs, RoPE + KV write, paged attention; Triton interpreter on CPU). Its greedy tokens and
log-probs must equal the engine's transformers forward; unsupported models must run as before."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams
from tests.conftest import count_small_batch_rows

ENGINE = dict(attention_backend="triton", async_scheduling=False)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _assert_same_logprobs(got, want) -> None:
    """The logits agree, not only their argmax: each step's top log-probs, to 1e-4."""
    for a, b in zip(got, want):
        for da, db in zip(a.logprobs, b.logprobs):
            assert da.keys() == db.keys()
            for tok in da:
                assert da[tok] == pytest.approx(db[tok], abs=1e-4)


# llama; mistral with a sliding window shorter than the prompts; qwen2 with q/k/v biases; the
# families below at up to 8 rows, with the 3-token prompt through the general attention kernel
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2"])
def test_small_batch_forward_matches_transformers_forward(tiny_model, arch, monkeypatch):
    from hf_paged import kernels

    decode_calls = []  # decode steps (one token a sequence) take kernels/decode_attention.py
    real = kernels.decode_attention
    monkeypatch.setattr(
        kernels,
        "decode_attention",
        lambda q, *a, **kw: decode_calls.append(q.shape[0]) or real(q, *a, **kw),
    )
    model = tiny_model(arch)
    # a 3-token prompt is a small prefill step (causal among its tokens); the rest decode
    prompts = _prompts([3, 30, 9])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    plain = Engine(model, small_batch_rows=0, **ENGINE)
    assert plain.runner.forward.small_batch is None
    want = plain.generate(prompts, params)
    plain.shutdown()
    eng = Engine(model, small_batch_rows=8, **ENGINE)  # every row count the kernels take
    decode_calls.clear()  # the start-up check's one decode step (engine/verify.py) is not ours
    seen = count_small_batch_rows(eng)
    got = eng.generate(prompts, params)
    eng.check_invariants()
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    _assert_same_logprobs(got, want)
    assert 3 in seen and max(seen) <= 8  # the 3-row decodes (and the 3-token prompt) ran fused
    # every layer of each fused decode step; not the 3-token prompt (general kernel)
    layers = model.config.num_hidden_layers
    assert set(decode_calls) == {3} and len(decode_calls) % layers == 0


def _transformers_greedy(model, prompt: list[int], max_new_tokens: int):
    """transformers' greedy tokens for one prompt, and each step's log-probs [steps, vocab]."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        min_new_tokens=max_new_tokens,  # as ignore_eos: no early stop on either side
        output_logits=True,
        return_dict_in_generate=True,
    )
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return out.sequences[0, len(prompt) :].tolist(), logprobs


# qwen3: q/k head norms (head_dim 32 != hidden / heads). phi3: the checkpoint's fused qkv_proj
# and gate_up_proj (MHA), and a sliding window of 12 (shorter than the prompts and outputs);
# phi3 with head_dim 24 (Phi-3-mini's 96 in small: no rotary tables, RoPE in a padded tile).
# gemma2: scaled embedding, (1 + w) sandwich norms, GELU(tanh), attention and final logit
# softcaps, query_pre_attn_scalar, a sliding-window layer (20) under the 30-token prompt.
FAMILIES = {
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {"sliding_window": 12}),
    "phi3-head24": ("phi3", {"hidden_size": 96}),
    "gemma2": ("gemma2", {}),
}


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_small_batch_forward_families_match_transformers_generate(
    tiny_model, case, one_torch_thread
):
    """Each family's batch-1 and batch-2 decodes (small_batch_rows=2) through the fused
    forward: greedy tokens equal transformers' generate of each prompt alone, float32, and so
    do the top log-probs (a final softcap or the activation can leave the argmax unchanged)."""
    arch, overrides = FAMILIES[case]
    model = tiny_model(arch, **overrides)
    lengths = [5, 30, 9]
    prompts = _prompts(lengths, seed=3)
    max_new = 5
    want = [_transformers_greedy(model, p, max_new) for p in prompts]
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, logprobs=3)
    eng = Engine(model, small_batch_rows=2, **ENGINE)
    assert eng.runner.forward.small_batch_status.startswith("on ("), (
        eng.runner.forward.small_batch_status
    )
    tables = eng.runner.forward.small_batch.cos_table is not None
    assert tables == (case in ("phi3",))  # the one-launch norm + q/k/v + RoPE where it applies
    seen = count_small_batch_rows(eng)
    for batch in ([prompts[0]], [prompts[1]], prompts[1:]):  # 1 and 2 sequences
        seen.clear()
        outs = eng.generate(batch, params)
        for out, prompt in zip(outs, batch):
            tokens, logprobs = want[prompts.index(prompt)]
            assert out.output_token_ids == tokens
            for step, top in enumerate(out.logprobs):
                assert len(top) >= 3
                for tok, lp in top.items():
                    assert lp == pytest.approx(logprobs[step, tok].item(), abs=1e-4)
        # every decode step ran fused: max_new - 1 of them, each of len(batch) rows
        assert seen == [len(batch)] * (max_new - 1)
    eng.check_invariants()
    eng.shutdown()


@pytest.mark.parametrize(
    "rope,tables",
    [
        (None, True),  # cos/sin tables over positions: norm + q/k/v + RoPE + KV write, one launch
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0}, True),
        ({"rope_type": "dynamic", "factor": 2.0}, False),  # rescales with length: per step
    ],
)  # fmt: skip
def test_rotary_tables_or_per_step_rotary(tiny_model, rope, tables):
    model = tiny_model("llama", **({"rope_scaling": rope} if rope else {}))
    prompts = _prompts([3, 40, 9], seed=2)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = Engine(model, small_batch_rows=0, **ENGINE).generate(prompts, params)
    eng = Engine(model, small_batch_rows=8, **ENGINE)
    assert (eng.runner.forward.small_batch.cos_table is not None) == tables
    seen = count_small_batch_rows(eng)
    got = eng.generate(prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert 3 in seen


def test_steps_past_two_rows_take_the_tensor_core_products(tiny_model, monkeypatch):
    """Steps of 1-2 tokens: norm + q/k/v + RoPE in one launch and the row-serial GEMVs; of 3+
    tokens: the products on kernels/fused_gemm_rows.py and q/k/v as GEMV + rope_write_kv (the
    one-launch kernel's GEMV would compute its rows one by one)."""
    import importlib

    from hf_paged import kernels

    fg = importlib.import_module("hf_paged.kernels.fused_gemv")
    one_launch, tensor_core = [], []
    real_qkv, real_rows = kernels.norm_qkv_rope, fg.fused_gemm_rows
    monkeypatch.setattr(
        kernels,
        "norm_qkv_rope",
        lambda h, *a, **kw: one_launch.append(h.shape[0]) or real_qkv(h, *a, **kw),
    )
    monkeypatch.setattr(
        fg,
        "fused_gemm_rows",
        lambda x, w, **kw: (
            tensor_core.append(len(kw["rows"]) if kw.get("rows") is not None else x.shape[0])
            or real_rows(x, w, **kw)
        ),
    )
    model = tiny_model("llama", num_hidden_layers=2)
    prompts = _prompts([5, 30, 9], seed=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = Engine(model, small_batch_rows=0, **ENGINE).generate(prompts, params)
    eng = Engine(model, small_batch_rows=8, **ENGINE)
    assert eng.runner.forward.small_batch.cos_table is not None  # one launch where it applies
    seen = count_small_batch_rows(eng)
    one_launch.clear(), tensor_core.clear()
    got = eng.generate(prompts, params) + eng.generate(prompts[:1], params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want + want[:1]]
    assert 3 in seen and 1 in seen
    assert one_launch and max(one_launch) <= kernels.ROW_SERIAL_ROWS
    assert tensor_core and min(tensor_core) > kernels.ROW_SERIAL_ROWS


def test_small_batch_rows_bounds_the_steps_that_run_fused(tiny_model):
    model = tiny_model("llama")
    prompts = _prompts([5, 6, 7, 8])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want = [
        o.output_token_ids
        for o in Engine(model, small_batch_rows=0, **ENGINE).generate(prompts, params)
    ]
    eng = Engine(model, small_batch_rows=2, **ENGINE)
    seen = count_small_batch_rows(eng)
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    assert not seen  # 4-row decodes and 26-token prefills: none fit 2 rows
    got = [o.output_token_ids for o in eng.generate(prompts[:2], params)]
    assert got == want[:2] and seen and max(seen) == 2


@pytest.mark.parametrize(
    "arch,overrides,options,reason",
    [
        ("gpt_neox", {}, {}, "model_type"),  # parallel residual, partial rotary
        ("olmo2", {}, {}, "model_type"),  # norms after attention, q/k norms over all heads
        ("phi3", {"partial_rotary_factor": 0.5}, {}, "partial rotary"),  # half of each head
        ("gemma2", {"hidden_activation": "gelu"}, {}, "activation 'gelu'"),  # exact erf GELU
        ("llama", {}, {"fuse_projections": False}, "not fused"),  # needs fused q/k/v, gate/up
        ("llama", {}, {"attention_backend": "torch"}, "backend"),  # needs the Triton kernels
    ],
)
def test_unsupported_models_run_transformers_forward(tiny_model, arch, overrides, options, reason):
    model = tiny_model(arch, **overrides)
    opts = {**ENGINE, **options}
    eng = Engine(model, **opts)
    assert eng.runner.forward.small_batch is None
    status = eng.runner.forward.small_batch_status
    assert status.startswith("off (") and reason in status  # with the reason
    prompts, params = _prompts([4, 9]), SamplingParams(max_tokens=3, temperature=0)
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    eng.shutdown()
    want = Engine(model, small_batch_rows=0, **opts).generate(prompts, params)
    assert got == [o.output_token_ids for o in want]


def test_embedding_with_strided_rows_runs_transformers_forward(tiny_model):
    # the embedding kernel reads contiguous rows: a table stored transposed is refused at start-up
    model = tiny_model("llama")
    table = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = torch.nn.Parameter(table.detach().t().contiguous().t())
    eng = Engine(model, **ENGINE)
    assert eng.runner.forward.small_batch is None
    assert "embed_tokens.weight rows are not contiguous" in eng.runner.forward.small_batch_status
    eng.shutdown()


def test_default_runs_batch_1_and_2_fused(tiny_model):
    eng = Engine(tiny_model("llama"), **ENGINE)
    assert eng.runner.forward.small_batch.max_rows == 2
    assert eng.runner.forward.small_batch_status == "on (steps of <= 2 tokens)"  # CPU: no PDL
    seen = count_small_batch_rows(eng)
    eng.generate(_prompts([4, 9]), SamplingParams(max_tokens=3, temperature=0))
    assert set(seen) == {2}  # the two decodes; the 13-token prefill ran transformers' forward


@pytest.mark.parametrize("bad", [-1, 9, True, 2.0, "4"])
def test_small_batch_rows_validation(tiny_model, bad):
    with pytest.raises(ValueError, match="small_batch_rows"):
        Engine(tiny_model("llama"), small_batch_rows=bad, **ENGINE)


@pytest.mark.parametrize("rows,warmed", [(8, {1, 2, 4, 8}), (3, {1, 2, 3}), (2, {1, 2})])
def test_warm_up_compiles_every_row_count_it_will_run(tiny_model, monkeypatch, rows, warmed):
    from hf_paged.worker.startup import warm_up_kernels

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    eng = Engine(tiny_model("llama", num_hidden_layers=1), small_batch_rows=rows, **ENGINE)
    seen = count_small_batch_rows(eng)
    r = eng.runner  # what a CUDA engine runs at start-up:
    warm_up_kernels(r.forward, r.kv_caches, r.backend, eng.config, r.device)
    assert set(seen) == warmed  # the kernels' power-of-2 row variants (3 rows: the 4-row one)
    eng.shutdown()
    assert eng.runner.forward.small_batch is None


@pytest.mark.parametrize("tables", [True, False])
def test_lora_adapters_in_the_small_batch_forward(peft_model, tables, monkeypatch):
    """A PeftModel's adapters (different ranks and targets, rows with none) through the fused
    forward: each row's tokens and log-probs as the transformers forward's with the LoRA
    layers; with the one-launch norm + q/k/v + RoPE (the q/k/v deltas in its epilogue) and
    without it (the GEMV's epilogue, then RoPE + KV write)."""
    if not tables:  # the per-step rotary path
        from hf_paged.worker import small_batch_forward as sbf

        monkeypatch.setattr(sbf, "_half_rotary_tables", lambda model, n: (None, None))
    model = peft_model()
    prompts = _prompts([3, 12, 9, 7], seed=5)
    names = ["chat", "math", None, "code"]
    params = [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2, adapter=n)
        for n in names
    ]
    plain = Engine(model, small_batch_rows=0, **ENGINE)
    want = plain.generate(prompts, params)
    plain.shutdown()
    base = Engine(model, small_batch_rows=0, **ENGINE)  # without adapters: they change tokens
    unadapted = base.generate(
        prompts, [SamplingParams(**{**_plain(p), "adapter": None}) for p in params]
    )
    base.shutdown()
    assert [o.output_token_ids for o in unadapted] != [o.output_token_ids for o in want]
    eng = Engine(model, small_batch_rows=8, **ENGINE)
    fast = eng.runner.forward.small_batch
    assert fast is not None and (fast.cos_table is not None) == tables
    seen = count_small_batch_rows(eng)
    got = eng.generate(prompts, params)
    eng.check_invariants()
    assert 4 in seen  # the 4-row decode steps ran fused, with every adapter in them
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    _assert_same_logprobs(got, want)
    eng.shutdown()


def _plain(p: SamplingParams) -> dict:
    return dict(max_tokens=p.max_tokens, temperature=0, ignore_eos=True, logprobs=p.logprobs)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_lora_adapters_on_families_in_the_small_batch_forward(tiny_model, lora_b, arch):
    """LoRA on every projection of Qwen3 (deltas before the head norms) and Gemma 2 (o/down
    deltas before the sandwich norms, gate/up before GELU): each row's tokens and log-probs as
    the transformers forward's with the LoRA layers."""
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(
        tiny_model(arch), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets), "a"
    )
    model.add_adapter("b", peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets[3:]))
    torch.manual_seed(7)
    lora_b(model)
    model.eval()
    prompts = _prompts([3, 12, 9], seed=6)
    params = [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2, adapter=n)
        for n in ("a", "b", None)
    ]
    plain = Engine(model, small_batch_rows=0, **ENGINE)
    want = plain.generate(prompts, params)
    plain.shutdown()
    eng = Engine(model, small_batch_rows=8, **ENGINE)
    assert eng.runner.forward.small_batch is not None
    seen = count_small_batch_rows(eng)
    got = eng.generate(prompts, params)
    assert 3 in seen  # the 3-row decode steps ran fused, with both adapters in them
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    _assert_same_logprobs(got, want)
    eng.shutdown()
