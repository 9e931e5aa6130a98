"""OpenAI's completions and chat completions over the async engine front: prompts in, response
bodies or SSE chunks out.

A request's choices are its prompts times n (choice index = prompt * n + sample, as OpenAI).
Each choice keeps an IncrementalDetokenizer; the non-streamed text and the streamed pieces come
from the same tokens and the same stop-string cut, so they read the same.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache

from hf_paged.entrypoints.detokenizer import IncrementalDetokenizer, final_text
from hf_paged.entrypoints.fronts import EngineDead, QueueFull
from hf_paged.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest
from hf_paged.sampling_params import SamplingParams

# engine ValueErrors start with the field they are about; the API's name for it
_FIELD = re.compile(r"^\s*([a-z_]+)\b")
_API_NAMES = {"stop_strings": "stop", "prompt": "prompt"}


def _param_of(message: str) -> str | None:
    m = _FIELD.match(message)
    return _API_NAMES.get(m.group(1), m.group(1)) if m else None


def _submit_error(exc: Exception) -> APIError:
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), None, "rate_limit_error", "queue_full")
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), None, "server_error", "engine_dead")
    return APIError(400, str(exc), _param_of(str(exc)))


@dataclass(slots=True)
class Choice:
    detok: IncrementalDetokenizer
    num_tokens: int = 0  # output tokens so far
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # new, unsent
    finish_reason: str | None = None
    started: bool = False  # the chat role delta went out
    text_offset: int = 0  # completions logprobs: characters of the tokens sent so far


class OpenAIServing:
    """front: an AsyncEngine (engine loop thread) or an EngineProcess (engine process), same
    interface; adapters: served name -> the PeftModel's LoRA adapter it runs; model_name runs
    the base."""

    def __init__(self, front, model_name: str, adapters: dict[str, str] | None = None) -> None:
        self.front = front
        self.tokenizer = front.tokenizer
        self.model_name = model_name
        self.adapters = dict(adapters or {})
        self.max_model_len = front.max_model_len
        self.max_seq_tokens = front.max_seq_tokens  # the model length or the whole KV cache
        self._token_text = lru_cache(maxsize=1 << 16)(self._decode_one)

    @property
    def model_names(self) -> list[str]:
        return [self.model_name, *self.adapters]

    def adapter_of(self, name: str) -> str | None:
        """The adapter a request's `model` runs (None: the base), or a 404 for an unknown name."""
        if name == self.model_name:
            return None
        if name not in self.adapters:
            raise APIError(
                404, f"The model {name!r} does not exist (served: {self.model_names})", "model",
                code="model_not_found",
            )  # fmt: skip
        return self.adapters[name]

    # -- prompts ---------------------------------------------------------------------------------

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        out = []
        for p in body.prompts():
            ids = self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p)
            out.append(self._check_prompt(ids, "prompt"))
        return out

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400,
                "the model's tokenizer has no chat template: use /v1/completions",
                "messages",
            )
        messages = [m.as_template_message() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # a template may raise on what it does not accept
            raise APIError(400, f"the chat template refused the messages: {exc}", "messages")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._check_prompt(ids, "messages")

    def _check_prompt(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{param}: the prompt is empty", param)
        if len(ids) >= self.max_seq_tokens:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_seq_tokens} tokens. However, "
                f"your prompt has {len(ids)} tokens, which leaves no room for output.",
                param,
                code="context_length_exceeded",
            )
        return ids

    def params(self, body, prompts: list[list[int]], max_tokens: int | None, num_logprobs):
        if max_tokens is None:  # as much as the longest prompt leaves
            max_tokens = self.max_seq_tokens - max(len(p) for p in prompts)
        try:
            return body.sampling_params(max_tokens, num_logprobs, self.adapter_of(body.model))
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc))) from None

    def submit(self, prompts: list[list[int]], params: SamplingParams, model: str):
        try:
            return self.front.submit(prompts, params, model)
        except (QueueFull, EngineDead, ValueError) as exc:
            raise _submit_error(exc) from None

    async def admitted(self, handle) -> None:
        """Wait for the engine to accept the handle's requests (at once in one process; an
        engine process validates them and answers): its refusal is raised as submit's is."""
        try:
            await handle.admitted()
        except (EngineDead, ValueError) as exc:
            raise _submit_error(exc) from None

    # -- running -----------------------------------------------------------------------------------

    def _choices(self, handle, stop: list[str] | None) -> list[Choice]:
        return [Choice(IncrementalDetokenizer(self.tokenizer, stop)) for _ in handle.request_ids]

    async def _outputs(self, handle) -> AsyncIterator[list]:
        while not handle.finished:
            try:
                outs = await handle.next_outputs()
            except EngineDead as exc:
                raise APIError(500, f"the engine failed: {exc}", None, "server_error") from None
            if outs:
                yield outs

    def _take(self, handle, choices: list[Choice], outs: list, want_lp):
        """File a choice's outputs of one wake-up (in arrival order) on it; returns the new
        text, or None if the choice had already ended. The tokens of all of them go through
        the detokenizer in one call (DecodeStream costs less per token in one batch)."""
        last = outs[-1]
        c = choices[handle.index[last.request_id]]
        if c.finish_reason is not None:
            return None
        new = (
            outs[0].new_token_ids if len(outs) == 1 else [t for o in outs for t in o.new_token_ids]
        )
        c.token_ids += new
        c.num_tokens = last.num_tokens - len(last.prompt_token_ids)
        if want_lp and last.logprobs is not None:  # the request's list: one entry per token
            first = c.num_tokens - len(new)
            c.logprobs += [(t, last.logprobs[first + k]) for k, t in enumerate(new)]
        piece = c.detok.add(new, last.finished)
        if c.detok.stopped:
            c.finish_reason = "stop"
            if not last.finished:
                handle.end_early(last.request_id)
        elif last.finished:
            c.finish_reason = last.finish_reason
        return piece

    async def stream(self, handle, choices, want_lp, base, make_choice, usage_of):
        """The SSE chunks of a streamed response: at most one event per choice per wake-up
        (make_choice(i, text, choice) builds it, or None to send nothing), all of them in one
        write; then usage_of() if asked for, and [DONE].

        A stream that falls behind (the engine hands outputs over every few steps, or the
        event loop is busy with other streams) finds several outputs of a choice waiting: they
        go out as one delta holding every token since the last write, as vLLM does and OpenAI
        clients accept. So the HTTP side costs one JSON event and one write per stream per
        wake-up however many tokens arrived."""
        prefix = _event_prefix(base)
        index = handle.index
        async for outs in self._outputs(handle):
            by_choice: dict[int, list] = {}
            for out in outs:
                by_choice.setdefault(index[out.request_id], []).append(out)
            events = []
            for i, group in by_choice.items():
                piece = self._take(handle, choices, group, want_lp)
                if piece is None:
                    continue
                choice = make_choice(i, piece, choices[i])
                if choice is not None:
                    events.append(f"{prefix}{choice_json(choice)}]}}\n\n")
            if events:
                yield "".join(events)
        usage = usage_of()
        if usage is not None:
            yield sse({**base, "choices": [], "usage": usage})
        yield SSE_DONE

    async def run_full(self, handle, choices, want_lp) -> None:
        """Wait for every choice to finish (non-streamed)."""
        async for outs in self._outputs(handle):
            for out in outs:
                i = handle.index[out.request_id]
                c = choices[i]
                if c.finish_reason is not None:
                    continue
                c.token_ids += out.new_token_ids
                c.num_tokens = out.num_tokens - len(out.prompt_token_ids)
                if out.finished:
                    c.finish_reason = out.finish_reason
                    if want_lp and out.logprobs is not None:
                        c.logprobs = list(zip(c.token_ids, out.logprobs))

    def finish_texts(self, choices: list[Choice], stop: list[str] | None) -> list[str]:
        texts = []
        for c in choices:
            text, cut = final_text(self.tokenizer, c.token_ids, stop)
            if cut:
                c.finish_reason = "stop"
            texts.append(text)
        return texts

    @staticmethod
    def usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
        p = sum(len(ids) for ids in prompts)
        c = sum(ch.num_tokens for ch in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # -- logprobs ------------------------------------------------------------------------------

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, entries, choice: Choice) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        offset = choice.text_offset
        for token, entry in entries:
            text = self._token_text(token)
            tokens.append(text)
            lps.append(entry.get(token))
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            tops.append({self._token_text(t): v for t, v in ranked})
            offsets.append(offset)
            offset += len(text)
        choice.text_offset = offset
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(self, entries, n: int) -> dict:
        content = []
        for token, entry in entries:
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
            content.append(
                {
                    **self._lp_token(token, entry.get(token)),
                    "top_logprobs": [self._lp_token(t, v) for t, v in ranked],
                }
            )
        return {"content": content}

    def _lp_token(self, token: int, logprob: float | None) -> dict:
        text = self._token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    # -- response shapes -----------------------------------------------------------------------

    @staticmethod
    def head(kind: str, model: str) -> dict:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}


_dumps = json.JSONEncoder(separators=(",", ":")).encode
_string = json.encoder.encode_basestring_ascii  # the C function _dumps escapes strings with


def choice_json(choice: dict) -> str:
    """_dumps(choice), byte for byte, for a streamed chunk's choice: the per-token shapes
    (completions' text, chat's content delta; no logprobs) written directly, the rest through
    the encoder. Every token of every stream goes through here on the event loop, which the
    server's runs showed busy to the end (evals/RESULTS.md); the encoder's walk of a small dict
    cost 2.7 us on a 2-core AMD EPYC against 0.2 us this way (timeit, 2026-12-04)."""
    reason = choice["finish_reason"]
    if choice["logprobs"] is not None or (reason is not None and type(reason) is not str):
        return _dumps(choice)
    tail = f',"logprobs":null,"finish_reason":{"null" if reason is None else _string(reason)}}}'
    if "text" in choice and len(choice) == 4:
        return f'{{"index":{choice["index"]:d},"text":{_string(choice["text"])}{tail}'
    delta = choice.get("delta")
    if len(choice) != 4 or type(delta) is not dict or delta.keys() - {"content"}:
        return _dumps(choice)  # the role delta (once a choice) and any other shape
    body = f'{{"content":{_string(delta["content"])}}}' if delta else "{}"
    return f'{{"index":{choice["index"]:d},"delta":{body}{tail}'


def sse(payload: dict) -> str:
    return f"data: {_dumps(payload)}\n\n"


def _event_prefix(base: dict) -> str:
    """`data: {...base fields...,"choices":[`: the part of a chunk event that is the same for
    every chunk of a response, serialised once (a choice and `]}` complete it)."""
    return f'data: {_dumps(base)[:-1]},"choices":['


SSE_DONE = "data: [DONE]\n\n"
