"""Requests in: validation, tokenisation and the Request objects the scheduler takes.

Runs in the caller's thread and touches no engine state, so a bad input raises ValueError (naming
the field) before anything is queued, and adding never waits behind a step.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from numbers import Integral

import torch

from hf_paged.config import EngineConfig
from hf_paged.core.request import Request
from hf_paged.engine.stop_checker import build_stop_checkers
from hf_paged.request_ids import sibling_request_id
from hf_paged.sampling_params import (
    F_PRESENCE,
    F_RENORM,
    F_REPETITION,
    F_STRUCTURED,
    F_WARP,
    SamplingParams,
)


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        vocab_size: int,
        num_kv_blocks: int,
        device: torch.device,
        default_eos: int | list[int] | None,  # the model's generation_config.eos_token_id
        lora_check=None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.device = device
        eos = default_eos
        self.default_eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        # (adapter name) -> None, or ValueError naming the field (hf_paged.lora.routing
        # LoraRouting.check); None: a model without LoRA
        self.lora_check = lora_check
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        # structured output: the grammar compiler (worker thread + cache), made on first use
        self.grammars = None
        self._grammars_lock = threading.Lock()

    def make_groups(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None,
        request_ids: Sequence[str | None] | None = None,
    ) -> list[list[Request]]:
        """make_requests for each prompt (one params for all, or one each; ids or None), every
        prompt validated before any request exists: a group is a prompt and its n - 1 siblings."""
        if isinstance(prompts, (str, torch.Tensor)):
            raise ValueError("prompts must be a list of prompts (a list of one for one prompt)")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        if request_ids is None:
            request_ids = [None] * len(prompts)
        if len(request_ids) != len(prompts):
            raise ValueError(f"request_ids: {len(request_ids)} given for {len(prompts)} prompts")
        return [self.make_requests(*args) for args in zip(prompts, params, request_ids)]

    def make_requests(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> list[Request]:
        """Validate one prompt's request and build it, with its n - 1 siblings."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        cfg = self.config
        if params.n > cfg.max_num_seqs:
            raise ValueError(f"n: {params.n} samples exceed max_num_seqs ({cfg.max_num_seqs})")
        prompt_ids = self.prompt_token_ids(prompt)
        n = len(prompt_ids)
        max_total = n + params.max_tokens
        if max_total > cfg.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {max_total} "
                f"exceeds max_model_len ({cfg.max_model_len})"
            )
        blocks = -(-max_total // cfg.block_size)
        if blocks > self.num_kv_blocks:
            raise ValueError(
                f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) needs "
                f"{blocks} KV blocks, the cache has {self.num_kv_blocks}"
            )
        eos = params.eos_token_id if params.eos_token_id is not None else self.default_eos_token_ids
        stop = set() if params.ignore_eos else set(eos)
        stop.update(params.stop_token_ids or ())
        _check_vocab(params, self.vocab_size)
        self._check_lora(params)
        stop_checkers = build_stop_checkers(params, self.tokenizer)
        banned, bad_word_prefixes = token_bans(params, eos)
        # every sampling option that reads the token history on the host rules out running
        # ahead of the host (asynchronous scheduling); a grammar reads it too, but the runner
        # lands the previous step's tokens for its matchers before sampling (model_runner.py),
        # and penalties count the token still in flight from the device (TokenCountPool.sync)
        async_ok = (
            not params.features & ~(F_WARP | F_RENORM | F_STRUCTURED | F_REPETITION | F_PRESENCE)
            and not params.prompt_logprobs
            and params.n == 1
            and not params.prompt_lookup_num_tokens  # its proposals read the tokens
        )
        if params.prompt_lookup_num_tokens and cfg.draft_model is not None:
            raise ValueError(
                "prompt_lookup_num_tokens: this engine speculates with its draft model "
                "(draft_model=); prompt lookup is for engines without one"
            )
        if params.prompt_lookup_num_tokens and params.beam_search:
            raise ValueError("prompt_lookup_num_tokens: not supported with beam search")
        grammar = self._grammar(params, stop) if params.structured is not None else None
        requests = []
        for index in range(params.n):
            rid = sibling_request_id(request_id, index)
            generator = None
            if params.seed is not None:  # sibling k: its own stream, derived from the seed
                seed = params.seed if index == 0 else hash((params.seed, index)) & (2**63 - 1)
                generator = torch.Generator(device=self.device).manual_seed(seed)
            request = Request(
                request_id=rid,
                prompt_token_ids=prompt_ids,
                sampling_params=params,
                eos_token_ids=frozenset(stop),
                max_total_tokens=max_total,
                priority=priority,
                arrival_index=next(self._arrivals),
                generator=generator,
                sibling_index=index,
                parent_request_id=None if index == 0 else request_id,
                stop_checkers=list(stop_checkers) if stop_checkers else None,
                banned_token_ids=banned,
                bad_word_prefixes=bad_word_prefixes,
            )
            request.async_ok = async_ok
            request.grammar = grammar  # one compiled grammar; each sibling its own matcher
            requests.append(request)
        return requests

    def prompt_token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: a string prompt needs Engine(model, tokenizer)")
            prompt = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, torch.Tensor):
            if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.ndim != 1:
                raise ValueError(
                    "prompt: a tensor prompt must be 1-D integer token ids, got "
                    f"{prompt.dtype} of shape {tuple(prompt.shape)}"
                )
            prompt = prompt.tolist()
        if type(prompt) is list and prompt and all(type(t) is int for t in prompt):
            # the usual prompt (a server's, a tokenizer's): plain ints, checked in C-speed calls
            # (the general checks below cost ~8x as much: ~50 ms of a server's event loop for
            # 256 W1 prompts)
            if 0 <= min(prompt) and max(prompt) < self.vocab_size:
                return prompt.copy()
        if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Iterable):
            raise ValueError(
                f"prompt must be a string or a sequence of integer token ids, got {prompt!r:.80}"
            )
        ids = list(prompt)
        wrong = [t for t in ids if not isinstance(t, Integral) or isinstance(t, bool)]
        if wrong:  # 1.5 or True silently taken as 1 would run a different prompt
            raise ValueError(f"prompt token ids must be integers, got {wrong[:5]!r}")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        return ids

    def _grammar(self, params: SamplingParams, stop: set[int]):
        """The request's GrammarHandle: parsed here (a bad constraint raises ValueError naming
        its field), compiled in the background."""
        field = params.structured.field_name
        if self.tokenizer is None:
            raise ValueError(f"{field}: structured output needs Engine(model, tokenizer)")
        if self.config.draft_model is not None:
            raise ValueError(
                f"{field}: not supported on an engine with a draft model (speculation is not "
                "checked against grammars)"
            )
        if not stop:
            raise ValueError(
                f"{field}: needs an end-of-sequence token to end on: the model's generation "
                "config has none; pass eos_token_id or stop_token_ids"
            )
        with self._grammars_lock:
            if self.grammars is None:
                from hf_paged.structured_output.compiler import GrammarService

                self.grammars = GrammarService(self.tokenizer, self.vocab_size)
        return self.grammars.submit(params.structured)

    def shutdown(self) -> None:
        """Stop the grammar compiler's worker thread, if one was started."""
        if self.grammars is not None:
            self.grammars.shutdown()

    def _check_lora(self, params: SamplingParams) -> None:
        name = params.adapter
        if name is None:
            return
        if self.lora_check is None:
            raise ValueError(f"adapter: {name!r} given, but the model has no LoRA adapters")
        self.lora_check(name)


def _check_vocab(params: SamplingParams, vocab_size: int) -> None:
    for seq in params.bad_words_ids or ():
        bad = [t for t in seq if t >= vocab_size]
        if bad:  # as transformers' SequenceBiasLogitsProcessor
            raise ValueError(
                f"bad_words_ids: token ids {bad} outside the vocabulary [0, {vocab_size})"
            )
    bad = [t for t in params.forced_eos_token_id or () if t >= vocab_size]
    if bad:
        raise ValueError(
            f"forced_eos_token_id: token ids {bad} outside the vocabulary [0, {vocab_size})"
        )
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs: {params.logprobs} exceeds the vocabulary size {vocab_size}")


def token_bans(
    params: SamplingParams, eos: list[int]
) -> tuple[list[int], list[tuple[tuple[int, ...], int]]]:
    """The request's token bans: suppress_tokens and one-token bad words always (sorted ids),
    longer bad words after their prefix ((prefix, last) pairs). As in transformers, a bad word
    equal to [eos] is dropped."""
    banned = list(params.suppress_tokens or ())
    prefixes = []
    for seq in params.bad_words_ids or ():
        if len(seq) == 1:
            if seq[0] not in eos:
                banned.append(seq[0])
        else:
            prefixes.append((tuple(seq[:-1]), seq[-1]))
    return sorted(set(banned)), prefixes
