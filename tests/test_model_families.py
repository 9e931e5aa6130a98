"""Families outside the Llama-like mould, exact under the engine: decoders that route attention
through transformers' interface without the class flag (StableLM, Bart's decoders), attention
cores swapped where the family calls no interface (GPT-Neo, OpenAI-GPT, GPT-NeoX-Japanese),
attention forwards swapped (Bloom, MPT, Falcon, XGLM, the BERT-style decoders RoFormer,
MegatronBERT, RemBERT, BigBird), positions built inside the model (Bart's kin: the step's
positions), BERT-family LM heads (causal only with is_decoder=True; RoBERTa's position ids as
generate passes them). Each: a tiny random float32 model, greedy, a left-padded batch of mixed
lengths against transformers one prompt at a time."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged

COMMON = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, is_decoder=True)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
BART_DECODER = dict(
    d_model=64,
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_ffn_dim=128,
    max_position_embeddings=128,
)
# model_type -> config overrides (the fields differ by family)
FAMILIES = {
    "stablelm": dict(SMALL, num_key_value_heads=2, partial_rotary_factor=0.25),
    "blenderbot-small": BART_DECODER,
    "marian": dict(BART_DECODER, decoder_start_token_id=0),
    "roberta": dict(SMALL, max_position_embeddings=130),
    "bert": dict(SMALL, max_position_embeddings=128),
    # attention cores swapped (integrations/attention_adapters.py); GPT-Neo's local layers
    # see 16 keys, shorter than the longer prompts
    "gpt_neo": dict(
        hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=16, max_position_embeddings=128,
    ),
    "openai-gpt": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "gpt_neox_japanese": dict(SMALL, max_position_embeddings=128),
    # forwards swapped (integrations/attention_forwards.py): inline attention, ALiBi slopes
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
    "mpt": dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=128),
    "falcon": dict(SMALL, num_kv_heads=1, max_position_embeddings=128),  # rotary, multi-query
    "xglm": dict(d_model=64, num_layers=2, attention_heads=4, ffn_dim=128,
                 max_position_embeddings=128),
    "mvp": BART_DECODER,
    # its decoder self-attention keeps is_causal=False (causal by the decoder's mask)
    "bigbird_pegasus": BART_DECODER,
    # BERT-style self-attention swapped the same way (decoders: is_decoder=True); RoFormer
    # rotates inside its self-attention (values too: its rotary_value variant below)
    "roformer": dict(SMALL, max_position_embeddings=128),
    "megatron-bert": dict(SMALL, max_position_embeddings=128),
    "rembert": dict(SMALL, input_embedding_size=32, output_embedding_size=48,
                    max_position_embeddings=128),
    "big_bird": dict(SMALL, attention_type="original_full", max_position_embeddings=128),
    "trocr": dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
                  max_position_embeddings=128),
}  # fmt: skip
# the same type again with other overrides: id -> (model_type, overrides)
VARIANTS = {
    # Falcon-RW's ALiBi (scaled with the scores), 8 heads: non-power-of-2 slope spacing
    "falcon-alibi": ("falcon", dict(SMALL, num_attention_heads=8, alibi=True, multi_query=False,
                                    new_decoder_architecture=False, max_position_embeddings=128)),
    "roformer-rotary-value": ("roformer", dict(SMALL, rotary_value=True,
                                               max_position_embeddings=128)),
    "falcon-new-arch": ("falcon", dict(SMALL, num_kv_heads=2, new_decoder_architecture=True,
                                       max_position_embeddings=128)),
}  # fmt: skip
LENGTHS = [5, 23, 40]
NEW_TOKENS = 8


def _build(name: str, **overrides) -> torch.nn.Module:
    model_type, fields = VARIANTS.get(name) or (name, FAMILIES[name])
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **fields, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    with torch.no_grad():  # well-separated greedy choices
        model.get_output_embeddings().weight.mul_(8.0)
    return model


@torch.inference_mode()
def _greedy(model, ids, mask):
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS
    )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("name", [*FAMILIES, *VARIANTS])
def test_family_is_exact_on_a_mixed_batch(name, batch_factory, one_torch_thread):
    check_exact(name, batch_factory)


@pytest.mark.parametrize("name", ["bloom", "falcon-alibi"])
def test_alibi_through_the_triton_kernels(name, batch_factory, one_torch_thread):
    """The ALiBi models through the Triton kernels (interpreted on CPU) as well."""
    # head_dim 16: the kernels' smallest
    check_exact(name, batch_factory, {"hidden_size": 128}, attention_backend="triton")


def test_forced_eos_as_bart_checkpoints_set_it(batch_factory, one_torch_thread):
    """Bart-family checkpoints set generation_config.forced_eos_token_id: the last new token is
    that id, as in transformers."""
    model = _build("blenderbot-small")
    model.generation_config.forced_eos_token_id = 2
    got = check_exact("blenderbot-small", batch_factory, model=model)
    assert (got[:, -1] == 2).all()


def check_exact(name, batch_factory, build=None, model=None, **options):
    model = model or _build(name, **(build or {}))
    ids, mask = batch_factory(LENGTHS, vocab=256)
    refs = [
        _greedy(model, ids[i : i + 1, -n:], mask[i : i + 1, -n:]) for i, n in enumerate(LENGTHS)
    ]
    classes = {type(m) for m in model.modules()}
    hf_paged.patch(model, max_model_len=128, **options)
    try:
        got = _greedy(model, ids, mask)
    finally:
        hf_paged.unpatch(model)
    for i, ref in enumerate(refs):
        assert torch.equal(got[i], ref[0]), (name, i, got[i], ref[0])
    # unpatch leaves no instance-level forward behind
    assert {type(m) for m in model.modules()} == classes
    assert not any("forward" in m.__dict__ or "_attn" in m.__dict__ for m in model.modules())
    return got


def test_step_positions_replace_the_flat_batch_positions():
    """Blenderbot-small's decoder builds arange(T) for the flat batch: without the step's
    positions the second prompt of a batch would continue the first one's."""
    from hf_paged.integrations.step_positions import install_step_positions, remove_step_positions

    model = _build("blenderbot-small")
    assert install_step_positions(model) == 1
    assert install_step_positions(model) == 0  # already routed
    remove_step_positions(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_bidirectional_bert_is_refused_naming_is_causal():
    model = _build("bert", is_decoder=False)
    with pytest.raises(ValueError, match=r"is_causal=False.*is_decoder=True"):
        hf_paged.patch(model)
    assert model.config._attn_implementation != "hf_paged"


def test_swapped_cores_are_put_back_and_named_layers_removed():
    from hf_paged.integrations.attention_adapters import (
        install_attention_adapters,
        remove_attention_adapters,
    )

    model = _build("openai-gpt")
    assert install_attention_adapters(model) == 2
    assert [m.layer_idx for m in model.modules() if "_attn" in m.__dict__] == [0, 1]
    remove_attention_adapters(model)
    assert not any(hasattr(m, "layer_idx") or "_attn" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("name", ["falcon", "falcon-alibi", "falcon-new-arch"])
def test_falcon_split_is_transformers_split_without_list_indexing(name):
    """The adapter's head split (slices, capturable in a CUDA graph) equals Falcon's own
    _split_heads (list indices) in values and shapes, for its three layouts."""
    from hf_paged.integrations.attention_forwards import _falcon_split

    attn = _build(name).transformer.h[0].self_attention
    fused = torch.randn(2, 5, attn.query_key_value.out_features)
    for ours, theirs in zip(_falcon_split(attn, fused), attn._split_heads(fused), strict=True):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "name",
    ["bloom", "falcon-alibi", "mpt", "gpt_neo", "falcon", "falcon-new-arch"]
    + ["roformer", "roformer-rotary-value", "megatron-bert", "rembert", "big_bird"]
    + ["bigbird_pegasus"],
)
def test_swapped_families_on_the_gpu_with_graphs_and_compile(name, batch_factory):
    """The Triton kernels (ALiBi among them), CUDA graphs and torch.compile on the swapped
    modules: float32, greedy, against transformers on the same GPU."""
    model = _build(name, hidden_size=128).cuda()
    ids, mask = batch_factory(LENGTHS, vocab=256)
    ids, mask = ids.cuda(), mask.cuda()
    refs = [
        _greedy(model, ids[i : i + 1, -n:], mask[i : i + 1, -n:]) for i, n in enumerate(LENGTHS)
    ]
    hf_paged.patch(model, max_model_len=128)
    try:
        got = _greedy(model, ids, mask)
    finally:
        hf_paged.unpatch(model)
    for i, ref in enumerate(refs):
        assert torch.equal(got[i], ref[0]), (name, i, got[i], ref[0])


REFUSED = {
    # the reason names what the class computes that paged attention does not
    "prophetnet": (dict(hidden_size=64, num_decoder_layers=2, num_decoder_attention_heads=4,
                        num_encoder_layers=2, num_encoder_attention_heads=4,
                        decoder_ffn_dim=128, encoder_ffn_dim=128), r"n-gram.*relative-position"),
    "cpmant": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, dim_head=16,
                    dim_ff=128), r"segment and relative-position buckets"),
    "xlm": (dict(emb_dim=64, n_layers=2, n_heads=4, causal=True), r"pad_index"),
    "big_bird": (dict(SMALL, max_position_embeddings=128), r"attention_type='block_sparse'"),
    "roformer": (dict(SMALL, is_decoder=False), r"is_decoder=False"),
    "rwkv": (dict(hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                  intermediate_size=128), r"recurrence"),
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_families_not_run_exactly_are_refused_naming_why(model_type):
    fields, match = REFUSED[model_type]
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **fields})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    classes = {type(m) for m in model.modules()}
    with pytest.raises(ValueError, match=match):
        hf_paged.patch(model, max_model_len=128)
    assert model.config._attn_implementation != "hf_paged"
    # refused before anything on the model changed: no lease, no swapped forward
    assert {type(m) for m in model.modules()} == classes
    assert not any(
        "forward" in m.__dict__ or "_hf_paged_lease" in m.__dict__ for m in model.modules()
    )


def test_cross_attention_in_a_step_is_refused_naming_the_argument():
    """A swapped BERT-style self-attention class also serves cross-attention (keys from an
    encoder), which the paged cache does not hold: refused in a step, naming the argument."""
    from hf_paged.integrations.attention_forwards import (
        install_attention_forwards,
        remove_attention_forwards,
    )

    from hf_paged.worker.forward_context import forward_context

    model = _build("roformer")
    assert install_attention_forwards(model) == 2
    attn = model.roformer.encoder.layer[0].attention.self
    hidden = torch.randn(1, 3, 64)
    try:
        with forward_context(None), pytest.raises(ValueError, match="'encoder_hidden_states'"):
            attn(hidden, encoder_hidden_states=torch.randn(1, 4, 64))
    finally:
        remove_attention_forwards(model)
    assert attn(hidden, encoder_hidden_states=torch.randn(1, 4, 64))[0].shape == (1, 3, 64)
