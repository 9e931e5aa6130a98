"""`model.generate` through the engine, with transformers' arguments, defaults and output layout.

The whole batch enters continuous batching at once: each row's real tokens (the attention mask
picks them, so left and right padding both work) become one request; outputs are gathered back
into transformers' layout: [input_ids | new tokens], rows that stopped early padded with
pad_token_id after their end-of-sequence token.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_paged.sampling_params import SamplingParams

# generate() keyword arguments the engine does not implement yet: refused, never ignored.
UNSUPPORTED_ARGS = (
    "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
    "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
    "custom_generate", "assistant_tokenizer", "tokenizer", "inputs_embeds",
)
# GenerationConfig fields the engine honours (or that do not change the output).
SUPPORTED_FIELDS = {
    "max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
    "pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation",
    "cache_config", "return_dict_in_generate", "compile_config", "disable_compile",
    "transformers_version", "_from_model_config", "is_assistant",
}


def _check_generation_config(gen: GenerationConfig) -> None:
    defaults = GenerationConfig._get_default_generation_params()
    for key, value in gen.to_dict().items():
        if key in SUPPORTED_FIELDS or value is None:
            continue
        if key in defaults and value == defaults[key]:
            continue
        if key.startswith("assistant") or key in ("num_assistant_tokens_schedule",):
            continue  # only read when an assistant model is given, which is refused above
        if value in (False, 0, 0.0, 1.0) and key not in defaults:
            continue
        raise ValueError(
            f"generation option {key}={value!r} is not supported by hf_paged yet; "
            "unpatch the model (hf_paged.unpatch) to use transformers' own generate"
        )


def sampling_params_from_config(gen: GenerationConfig, max_new_tokens: int) -> SamplingParams:
    eos = gen.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if gen.do_sample:
        if gen.temperature is None or not gen.temperature > 0:
            raise ValueError(f"temperature must be > 0 when do_sample=True, got {gen.temperature!r}")
        return SamplingParams(
            max_tokens=max_new_tokens, temperature=float(gen.temperature),
            top_k=int(gen.top_k or 0), top_p=float(1.0 if gen.top_p is None else gen.top_p),
            eos_token_id=eos,
        )
    return SamplingParams(max_tokens=max_new_tokens, temperature=0.0, eos_token_id=eos)


def paged_generate(model, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
    engine = model._hf_paged_engine
    for name in UNSUPPORTED_ARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"generate({name}=...) is not supported by hf_paged yet")
        kwargs.pop(name, None)
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    attention_mask = kwargs.pop("attention_mask", None)
    gen, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None}
    if model_kwargs:
        raise ValueError(f"generate: argument(s) {sorted(model_kwargs)} are not supported by hf_paged")
    _check_generation_config(gen)
    if input_ids is None:
        raise ValueError("input_ids: generate needs input token ids")
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    batch, length = input_ids.shape
    if gen.max_new_tokens is not None:
        max_new = gen.max_new_tokens
    else:
        max_new = gen.max_length - length
        if max_new < 1:
            raise ValueError(
                f"max_length ({gen.max_length}) leaves no room after the {length}-token input; "
                "set max_new_tokens"
            )
    eos = gen.eos_token_id
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = gen.pad_token_id
    if pad is None and eos_list:
        pad = eos_list[0]  # as transformers does (it warns)
    if attention_mask is None:
        if pad is not None and pad not in eos_list and bool((input_ids == pad).any()):
            attention_mask = input_ids.ne(pad)
        else:
            attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}"
        )
    mask = attention_mask.bool().cpu()
    ids_cpu = input_ids.cpu()
    prompts = [ids_cpu[i][mask[i]].tolist() for i in range(batch)]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"input_ids row {i} is empty (its attention_mask is all zeros)")
    params = sampling_params_from_config(gen, max_new)
    outputs = engine.generate(prompts, params)

    longest = max(len(o.output_token_ids) for o in outputs)
    new = torch.full((batch, longest), -1 if pad is None else pad, dtype=input_ids.dtype)
    for i, o in enumerate(outputs):
        new[i, : len(o.output_token_ids)] = torch.tensor(o.output_token_ids, dtype=input_ids.dtype)
    if pad is None and bool((new < 0).any()):
        raise RuntimeError("rows ended at different lengths but no pad_token_id is set")
    sequences = torch.cat([input_ids, new.to(input_ids.device)], dim=1)
    if gen.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
