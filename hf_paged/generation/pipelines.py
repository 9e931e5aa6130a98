"""`pipeline("text-generation", ..., backend="paged")`: transformers' pipeline on the engine.

The pipeline object is transformers' own TextGenerationPipeline (same preprocessing, chat
templates, postprocessing and return formats) with one change: instead of running inputs one
batch at a time through model.generate, it preprocesses every input of a call (a list, or a
window of a dataset/generator) and submits them all to the engine at once, so they share
continuous batching. Each input keeps its own length semantics (max_length, min_length count its
own tokens, as when transformers runs it alone).
"""

from __future__ import annotations

from collections.abc import Sized

import torch
from transformers.pipelines.text_generation import TextGenerationPipeline
from transformers.utils import ModelOutput

from hf_paged.generation.generate import paged_generate_many

BACKENDS = ("hf", "paged")


class PagedTextGenerationPipeline(TextGenerationPipeline):
    # dataset / generator inputs: how many are in flight at once (lists go in whole)
    window: int = 1024

    def run_single(self, inputs, preprocess_params, forward_params, postprocess_params):
        return self._run_many([inputs], preprocess_params, forward_params, postprocess_params)[0]

    def get_iterator(
        self, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params
    ):
        return self._iterate(inputs, preprocess_params, forward_params, postprocess_params)

    def _iterate(self, inputs, preprocess_params, forward_params, postprocess_params):
        window = len(inputs) if isinstance(inputs, Sized) else self.window
        items = []
        for item in inputs:
            items.append(item)
            if len(items) >= window:
                yield from self._run_many(
                    items, preprocess_params, forward_params, postprocess_params
                )
                items = []
        if items:
            yield from self._run_many(items, preprocess_params, forward_params, postprocess_params)

    def _run_many(self, items, preprocess_params, forward_params, postprocess_params) -> list:
        model_inputs = [self.preprocess(item, **preprocess_params) for item in items]
        generate_kwargs = dict(forward_params)
        adapter = generate_kwargs.pop("adapter_name", None)
        if adapter is not None:  # a PeftModel's LoRA adapter for every input of the call
            if "adapter_names" in generate_kwargs:
                raise ValueError("adapter_name: give adapter_name or adapter_names, not both")
            generate_kwargs["adapter_names"] = [adapter] * len(model_inputs)
        prefix_length = generate_kwargs.pop("prefix_length", 0)
        generate_kwargs = self._prepare_generate_kwargs(generate_kwargs)
        if prefix_length:  # as transformers: a total length includes the prefix
            set_params = self._get_set_generation_params(generate_kwargs)
            for length, new_tokens in (
                ("max_length", "max_new_tokens"),
                ("min_length", "min_new_tokens"),
            ):
                if length in set_params and new_tokens not in set_params:
                    generate_kwargs[length] = set_params[length] + prefix_length
        pairs = []
        for mi in model_inputs:
            if mi["input_ids"].shape[1] == 0:
                raise ValueError("text_inputs: an empty prompt is not supported by hf_paged")
            pairs.append((mi["input_ids"], mi.get("attention_mask")))
        with torch.inference_mode():
            outputs = paged_generate_many(self.model, pairs, **generate_kwargs)
        return [
            self.postprocess(_model_outputs(out, mi), **postprocess_params)
            for out, mi in zip(outputs, model_inputs)
        ]


def _model_outputs(output, model_inputs) -> dict:
    """What TextGenerationPipeline._forward returns for one input, from generate's output."""
    input_ids = model_inputs["input_ids"]
    in_b = input_ids.shape[0]
    extra = {}
    if isinstance(output, ModelOutput):
        sequences = output.sequences
        out_b = sequences.shape[0]
        for key, value in output.items():
            if key in ("sequences", "cache"):
                continue
            if isinstance(value, torch.Tensor) and value.shape[0] == out_b:
                extra[key] = value.reshape(in_b, out_b // in_b, *value.shape[1:])
            elif isinstance(value, tuple) and len(value[0]) == out_b:
                stacked = torch.stack(value).swapaxes(0, 1)
                extra[key] = stacked.reshape(in_b, out_b // in_b, *stacked.shape[1:])
    else:
        sequences = output
    out_b = sequences.shape[0]
    return {
        "generated_sequence": sequences.reshape(in_b, out_b // in_b, *sequences.shape[1:]),
        "input_ids": input_ids,
        "prompt_text": model_inputs["prompt_text"],
        **extra,
    }


def pipeline(task=None, model=None, *args, backend: str = "paged", engine_options=None, **kwargs):
    """transformers.pipeline, with backend="paged" (default here) running text generation on the
    engine (engine_options: Engine options, e.g. block_size) and backend="hf" plain transformers."""
    from hf_paged.integrations.pipeline import original_pipeline

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    pipe = original_pipeline()(task, model, *args, **kwargs)
    if backend == "hf":
        return pipe
    if not isinstance(pipe, TextGenerationPipeline):
        raise ValueError(
            f"backend='paged' serves the text-generation task, not {type(pipe).__name__}; "
            "use backend='hf'"
        )
    from hf_paged.generation.patching import ENGINE_ATTR, patch

    if getattr(pipe.model, ENGINE_ATTR, None) is None or engine_options:
        patch(pipe.model, pipe.tokenizer, **(engine_options or {}))
    pipe.__class__ = PagedTextGenerationPipeline
    return pipe
