"""`model.generate` through the engine, with transformers' arguments, defaults and output layout.

The whole batch enters continuous batching at once: each row's real tokens (the attention mask
picks them, so left and right padding both work) become one request; outputs are gathered back
into transformers' layout: [input_ids | new tokens], rows that stopped early padded with
pad_token_id after their end-of-sequence token. GenerationConfig maps onto SamplingParams
field by field (sampling_params_from_config); anything the engine cannot honour is refused with a
ValueError naming it, never ignored.

Where the engine differs from transformers by construction: processors and stopping criteria see
a row's own tokens (no padding columns), so options that read padding (no_repeat_ngram_size and
multi-token bad_words_ids matching across left padding, a custom processor indexing columns)
can differ on padded batches; scores/logits rows of steps after a row finished are filler
(0 for pad_token_id, -inf elsewhere) where transformers computes them from the padding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_paged.generation.streaming import LockstepStreamer
from hf_paged.generation.structured import pop_structured
from hf_paged.lora import layers as lora_layers
from hf_paged.sampling_params import SamplingParams

# generate() keyword arguments the engine does not implement: refused, never ignored.
UNSUPPORTED_ARGS = (
    "prefix_allowed_tokens_fn",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "assistant_tokenizer",
    "inputs_embeds",
)
# GenerationConfig fields the engine honours (or that do not change the output).
SUPPORTED_FIELDS = {
    "max_length",
    "max_new_tokens",
    "min_length",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_eos_token_id",
    "renormalize_logits",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "decoder_start_token_id",
    "stop_strings",
    "max_time",
    "num_return_sequences",
    "output_scores",
    "output_logits",
    "num_beams",
    "length_penalty",
    "early_stopping",
    "use_cache",
    "cache_implementation",
    "cache_config",
    "return_dict_in_generate",
    "compile_config",
    "disable_compile",
    "transformers_version",
    "_from_model_config",
    "is_assistant",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
}
# A user processor of one of these types replaces the built-in one (transformers' merge rule);
# each is handled by the SamplingParams field named here, which is then switched off.
BUILTIN_PROCESSORS = {
    RepetitionPenaltyLogitsProcessor: "repetition_penalty",
    NoRepeatNGramLogitsProcessor: "no_repeat_ngram_size",
    NoBadWordsLogitsProcessor: "bad_words_ids",
    MinLengthLogitsProcessor: "min_length",
    # a custom MinNewTokensLengthLogitsProcessor adds to the built-in: transformers also keeps
    # the MinLengthLogitsProcessor it derives from min_new_tokens, which bans the same steps
    SuppressTokensLogitsProcessor: "suppress_tokens",
    SuppressTokensAtBeginLogitsProcessor: "begin_suppress_tokens",
}


def _check_generation_config(gen: GenerationConfig) -> None:
    defaults = GenerationConfig._get_default_generation_params()
    fresh = GenerationConfig().to_dict()
    for key, value in gen.to_dict().items():
        if key in SUPPORTED_FIELDS or value is None:
            continue
        same_as = [defaults[key]] if key in defaults else []
        same_as += [fresh[key]] if key in fresh else []
        if any(type(value) is type(d) and value == d for d in same_as) or value is False:
            continue
        if key in ("epsilon_cutoff", "eta_cutoff", "diversity_penalty") and value == 0.0:
            continue
        if key in ("num_beam_groups",) and value == 1:
            continue
        raise ValueError(
            f"generation option {key}={value!r} is not supported by hf_paged; "
            "unpatch the model (hf_paged.unpatch) to use transformers' own generate"
        )


def _eos_list(eos) -> list[int]:
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        return [int(t) for t in eos.flatten().tolist()]
    return [eos] if isinstance(eos, int) else [int(t) for t in eos]


def repetition_penalty(gen: GenerationConfig) -> float:
    """gen.repetition_penalty (None: off), refused as transformers refuses it."""
    p = gen.repetition_penalty
    if p is None:
        return 1.0
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
        # transformers' RepetitionPenaltyLogitsProcessor message
        raise ValueError(f"`penalty` has to be a strictly positive float, but is {p}")
    return float(p)


def sampling_params_from_config(
    gen: GenerationConfig,
    max_new_tokens: int,
    min_new_tokens: int = 0,
    logits_processors: list | None = None,
    stopping_criteria: list | None = None,
) -> SamplingParams:
    """One request's SamplingParams from a prepared GenerationConfig (lengths already per row).
    Warpers apply only with do_sample, as in transformers; greedy is temperature 0."""
    eos = _eos_list(gen.eos_token_id)
    kwargs = dict(
        max_tokens=max_new_tokens,
        min_tokens=max(min_new_tokens, 0),
        eos_token_id=eos,
        repetition_penalty=repetition_penalty(gen),
        no_repeat_ngram_size=int(gen.no_repeat_ngram_size or 0),
        bad_words_ids=gen.bad_words_ids,
        suppress_tokens=gen.suppress_tokens,
        begin_suppress_tokens=gen.begin_suppress_tokens,
        forced_eos_token_id=gen.forced_eos_token_id,
        renormalize_logits=bool(gen.renormalize_logits),
        output_scores=bool(gen.return_dict_in_generate and gen.output_scores),
        output_logits=bool(gen.return_dict_in_generate and gen.output_logits),
        logits_processors=logits_processors or None,
        stopping_criteria=stopping_criteria or None,
        n=int(gen.num_return_sequences or 1) if (gen.num_beams or 1) == 1 else 1,
        prompt_lookup_num_tokens=int(gen.prompt_lookup_num_tokens or 0),
        max_matching_ngram_size=int(gen.max_matching_ngram_size or 2),
    )
    if not gen.do_sample:
        return SamplingParams(temperature=0.0, **kwargs)
    if gen.temperature is None or not gen.temperature > 0:
        raise ValueError(f"temperature must be > 0 when do_sample=True, got {gen.temperature!r}")
    return SamplingParams(
        temperature=float(gen.temperature),
        top_k=int(gen.top_k or 0),
        top_p=float(1.0 if gen.top_p is None else gen.top_p),
        min_p=float(gen.min_p or 0.0),
        typical_p=float(1.0 if gen.typical_p is None else gen.typical_p),
        **kwargs,
    )


def _merge_processors(gen: GenerationConfig, custom) -> list | None:
    """transformers' merge rule: a custom processor of a built-in type replaces the built-in."""
    if not custom:
        return None
    for proc in custom:
        field = BUILTIN_PROCESSORS.get(type(proc))
        if field is not None:
            setattr(gen, field, None)
    return list(custom)


def _split_criteria(gen: GenerationConfig, custom, tokenizer) -> list:
    """Per-request stopping criteria: max_time, stop strings and the user's list. A custom
    MaxLengthCriteria or EosTokenCriteria replaces the built-in limit (transformers' merge rule)."""
    criteria = []
    custom = list(custom or [])
    if any(isinstance(c, StopStringCriteria) for c in custom):
        gen.stop_strings = None
    for c in custom:
        if isinstance(c, MaxLengthCriteria):
            gen.max_length, gen.max_new_tokens = c.max_length, None
        elif isinstance(c, EosTokenCriteria):
            gen.eos_token_id = _eos_list(c.eos_token_id)
        elif isinstance(c, MaxTimeCriteria):
            gen.max_time = None
            criteria.append(c)
        else:
            criteria.append(c)
    if gen.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=gen.max_time))
    if gen.stop_strings is not None:
        if tokenizer is None:
            raise ValueError(
                "stop_strings: matching stop strings needs the tokenizer; pass "
                "generate(tokenizer=...) or hf_paged.patch(model, tokenizer)"
            )
        criteria.append(StopStringCriteria(tokenizer, gen.stop_strings))
    return criteria


@dataclass(slots=True)
class GenerationPlan:
    """What one generate() call's options resolve to, shared by every row it submits."""

    gen: GenerationConfig
    processors: list | None
    criteria: list
    streamer: object | None
    has_default_max_length: bool
    pad: int | None
    eos: list[int]
    # peft's generate(adapter_names=[...]): one LoRA adapter per row, "__base__" for none
    adapter_names: list[str] | None = None
    # without adapter_names, peft runs its active adapter on every row: so does the engine
    active_adapter: str | None = None
    structured: object = None  # json_schema= / regex= / ...: a StructuredOutputs (structured.py)


@dataclass(slots=True)
class RowBatch:
    """One [batch, length] input of a plan: its rows' prompts and per-row SamplingParams."""

    input_ids: torch.Tensor
    prompts: list[list[int]]
    params: SamplingParams | None  # None for beam search
    max_new: int
    min_new: int

    @property
    def num_outputs(self) -> int:
        return len(self.prompts) * (self.params.n if self.params is not None else 1)


def plan_generation(model, generation_config, kwargs: dict) -> GenerationPlan:
    engine = model._hf_paged_engine
    for name in UNSUPPORTED_ARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"generate({name}=...) is not supported by hf_paged")
        kwargs.pop(name, None)
    if kwargs.pop("synced_gpus", None):
        raise ValueError("generate(synced_gpus=True) is not supported by hf_paged")
    assistant = kwargs.pop("assistant_model", None)
    if assistant is not None and assistant is not engine.config.draft_model:
        # the draft's KV cache and graphs are built with the engine
        raise ValueError(
            "assistant_model: hf_paged speculates with the draft model given when the model is "
            "patched: hf_paged.patch(model, draft_model=assistant), then generate() as usual"
        )
    structured = pop_structured(kwargs)
    custom_processors = kwargs.pop("logits_processor", None)
    custom_criteria = kwargs.pop("stopping_criteria", None)
    streamer = kwargs.pop("streamer", None)
    adapter_names = kwargs.pop("adapter_names", None)
    if adapter_names is not None and (
        isinstance(adapter_names, str) or not all(isinstance(a, str) for a in adapter_names)
    ):
        raise ValueError(f"adapter_names must be a list of adapter names, got {adapter_names!r}")
    tokenizer = kwargs.pop("tokenizer", None) or engine.tokenizer
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    gen, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None}
    if model_kwargs:
        names = sorted(model_kwargs)
        raise ValueError(f"generate: argument(s) {names} are not supported by hf_paged")
    gen.validate()
    _check_generation_config(gen)
    for name in ("num_beams", "num_return_sequences"):
        value = getattr(gen, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    processors = _merge_processors(gen, custom_processors)
    criteria = _split_criteria(gen, custom_criteria, tokenizer)
    if any(isinstance(c, MaxLengthCriteria) for c in custom_criteria or ()):
        has_default_max_length = False  # the custom limit counts the input, like max_length
    if (gen.num_beams or 1) > 1 and streamer is not None:
        raise ValueError("streamer cannot be used with beam search (as in transformers)")
    eos = _eos_list(gen.eos_token_id)
    pad = gen.pad_token_id
    if pad is None and eos:
        pad = eos[0]  # as transformers does (it warns)
    if (gen.num_beams or 1) > 1 and (assistant is not None or gen.prompt_lookup_num_tokens):
        raise ValueError(
            "assistant_model / prompt_lookup_num_tokens with num_beams > 1 (beam search) is not "
            "supported by hf_paged"
        )
    if gen.forced_eos_token_id is not None and (gen.num_beams or 1) > 1:
        raise ValueError("forced_eos_token_id with num_beams > 1 is not supported by hf_paged")
    if structured is not None and (gen.num_beams or 1) > 1:
        raise ValueError("num_beams: structured output is not supported with beam search")
    if adapter_names is not None and (gen.num_beams or 1) > 1:
        raise ValueError("adapter_names with num_beams > 1 is not supported by hf_paged yet")
    active = None if adapter_names is not None else lora_layers.active_adapter(model)
    if active is not None and (gen.num_beams or 1) > 1:
        raise ValueError(
            f"num_beams: beam search with a LoRA adapter (the PeftModel's active adapter "
            f"{active!r}) is not supported by hf_paged yet"
        )
    return GenerationPlan(
        gen, processors, criteria, streamer, has_default_max_length, pad, eos, adapter_names,
        active, structured,
    )  # fmt: skip


def prepare_rows(model, plan: GenerationPlan, input_ids, attention_mask) -> RowBatch:
    gen, pad = plan.gen, plan.pad
    if input_ids is None:
        raise ValueError("input_ids: generate needs input token ids")
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if (
        input_ids.dtype.is_floating_point
        or input_ids.dtype.is_complex
        or input_ids.dtype == (torch.bool)
    ):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.ndim != 2:  # as transformers' generate: a 1-D row is not a batch
        raise ValueError(
            f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)} "
            "(one prompt: input_ids[None])"
        )
    batch, length = input_ids.shape
    if gen.max_new_tokens is not None:
        max_new = gen.max_new_tokens
    elif plan.has_default_max_length:  # transformers: 20 new tokens, within the position limit
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        max_new = gen.max_length if limit is None else min(gen.max_length, limit - length)
    else:
        max_new = gen.max_length - length
    if max_new < 1:
        raise ValueError(
            f"max_length ({gen.max_length}) leaves no room after the {length}-token input; "
            "set max_new_tokens"
        )
    if gen.min_new_tokens is not None:
        min_new = gen.min_new_tokens
    else:
        min_new = (gen.min_length or 0) - length  # min_length counts the (padded) input
    if attention_mask is None:
        if pad is not None and pad not in plan.eos and bool((input_ids == pad).any()):
            attention_mask = input_ids.ne(pad)
        else:
            attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids "
            f"{tuple(input_ids.shape)}"
        )
    mask = attention_mask.bool().cpu()
    ids_cpu = input_ids.cpu()
    prompts = [ids_cpu[i][mask[i]].tolist() for i in range(batch)]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"input_ids row {i} is empty (its attention_mask is all zeros)")
    params = None
    if (gen.num_beams or 1) == 1:
        params = sampling_params_from_config(gen, max_new, min_new, plan.processors, plan.criteria)
        if plan.active_adapter is not None or plan.structured is not None:
            params = dataclasses.replace(
                params, adapter=plan.active_adapter, structured=plan.structured
            )
    return RowBatch(input_ids, prompts, params, max_new, min_new)


def paged_generate(model, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    attention_mask = kwargs.pop("attention_mask", None)
    return paged_generate_many(model, [(input_ids, attention_mask)], generation_config, **kwargs)[0]


def paged_generate_many(model, inputs: list, generation_config=None, **kwargs) -> list:
    """generate() for several (input_ids, attention_mask) inputs with the same options, all
    submitted to the engine at once; returns what generate() returns for each input."""
    engine = model._hf_paged_engine
    plan = plan_generation(model, generation_config, kwargs)
    batches = [prepare_rows(model, plan, ids, mask) for ids, mask in inputs]
    if (plan.gen.num_beams or 1) > 1:
        from hf_paged.generation.beam_search import beam_generate

        return beam_generate(engine, plan, batches)
    prompts = [p for b in batches for p in b.prompts]
    params = [b.params for b in batches for _ in b.prompts]
    if plan.adapter_names is not None:
        params = _with_adapters(params, plan.adapter_names)
    expanded = [
        b.input_ids.repeat_interleave(b.params.n, dim=0) if b.params.n > 1 else b.input_ids
        for b in batches
    ]
    if plan.streamer is not None:
        if len(batches) != 1:
            raise ValueError("streamer: one input per generate call")
        outputs = _run_streaming(engine, prompts, params, plan.streamer, expanded[0], plan.pad)
    else:
        outputs = engine.generate(prompts, params)
    results, start = [], 0
    for b, ids in zip(batches, expanded):
        outs = outputs[start : start + b.num_outputs]
        start += b.num_outputs
        results.append(_assemble(plan.gen, ids, [o.output_token_ids for o in outs], outs, plan.pad))
    return results


def _with_adapters(params: list[SamplingParams], names: list[str]) -> list[SamplingParams]:
    """Row i runs LoRA adapter names[i] (peft's adapter_names; "__base__": no adapter)."""
    if len(names) != len(params):
        raise ValueError(f"adapter_names: {len(names)} names for {len(params)} input rows")
    return [dataclasses.replace(p, adapter=name) for p, name in zip(params, names)]


def _run_streaming(engine, prompts, params, streamer, expanded, pad):
    final = {}
    with engine.stream(prompts, params) as stream:
        lockstep = LockstepStreamer(streamer, expanded, stream.request_ids, pad)
        for out in stream:
            if out.error is not None:  # a row's own stopping criterion or processor raised
                raise out.error
            lockstep.update(out)
            if out.finished:
                final[out.request_id] = out
        lockstep.end()
    aborted = [rid for rid in stream.request_ids if final[rid].finish_reason == "abort"]
    if aborted:
        raise RuntimeError(f"requests {aborted[:5]} were aborted before they finished")
    return [final[rid] for rid in stream.request_ids]


def _filler(vocab: int, pad: int | None, device) -> torch.Tensor:
    row = torch.full((vocab,), float("-inf"), device=device)
    row[0 if pad is None else pad] = 0.0
    return row


def _stack_steps(rows_per_seq: list[list[torch.Tensor]], steps: int, filler) -> tuple:
    """Per-request lists of [V] rows -> transformers' tuple of [batch, V], one per step."""
    return tuple(
        torch.stack([rows[s] if s < len(rows) else filler for rows in rows_per_seq])
        for s in range(steps)
    )


def _assemble(gen, input_ids, new_tokens: list[list[int]], outputs, pad):
    batch = input_ids.shape[0]
    longest = max(len(t) for t in new_tokens)
    new = torch.full((batch, longest), -1 if pad is None else pad, dtype=input_ids.dtype)
    for i, toks in enumerate(new_tokens):
        new[i, : len(toks)] = torch.tensor(toks, dtype=input_ids.dtype)
    if pad is None and bool((new < 0).any()):
        raise RuntimeError("rows ended at different lengths but no pad_token_id is set")
    sequences = torch.cat([input_ids, new.to(input_ids.device)], dim=1)
    if not gen.return_dict_in_generate:
        return sequences
    scores = logits = None
    if gen.output_scores or gen.output_logits:
        sample = next((r[0] for o in outputs for r in (o.scores, o.logits) if r), None)
        filler = _filler(sample.shape[-1], pad, sample.device) if sample is not None else None
        if gen.output_scores:
            scores = _stack_steps([o.scores or [] for o in outputs], longest, filler)
        if gen.output_logits:
            logits = _stack_steps([o.logits or [] for o in outputs], longest, filler)
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)
