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

from hf_paged.core.request import RequestOutput
from hf_paged.entrypoints.async_engine import AsyncEngine, EngineDead, QueueFull, RequestHandle
from hf_paged.entrypoints.detokenizer import IncrementalDetokenizer, final_text
from hf_paged.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest
from hf_paged.sampling_params import SamplingParams

# engine ValueErrors start with the field they are about; the API's name for it
_FIELD = re.compile(r"^\s*([a-z_]+)\b")
_API_NAMES = {"stop_strings": "stop", "prompt": "prompt"}


def _param_of(message: str) -> str | None:
    m = _FIELD.match(message)
    return _API_NAMES.get(m.group(1), m.group(1)) if m else None


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
    """adapters: served name -> the PeftModel's LoRA adapter it runs; model_name runs the base."""

    def __init__(
        self, front: AsyncEngine, model_name: str, adapters: dict[str, str] | None = None
    ) -> None:
        self.front = front
        self.tokenizer = front.tokenizer
        self.model_name = model_name
        self.adapters = dict(adapters or {})
        engine = front.engine
        self.max_model_len = front.max_model_len
        # what one sequence can hold: the smaller of the model length and the whole KV cache
        self.max_seq_tokens = min(
            self.max_model_len, engine.kv.num_blocks * engine.config.block_size
        )
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
        except QueueFull as exc:
            raise APIError(429, str(exc), None, "rate_limit_error", "queue_full") from None
        except EngineDead as exc:
            raise APIError(503, str(exc), None, "server_error", "engine_dead") from None
        except ValueError as exc:
            if "max_loras" in str(exc):  # more adapters live than slots: a retry later runs
                raise APIError(
                    429, str(exc), "model", "rate_limit_error", "too_many_adapters"
                ) from None
            raise APIError(400, str(exc), _param_of(str(exc))) from None

    # -- running -----------------------------------------------------------------------------------

    def _choices(self, handle: RequestHandle, stop: list[str] | None) -> list[Choice]:
        return [Choice(IncrementalDetokenizer(self.tokenizer, stop)) for _ in handle.request_ids]

    async def _outputs(self, handle: RequestHandle) -> AsyncIterator[list[RequestOutput]]:
        while not handle.finished:
            try:
                outs = await handle.next_outputs()
            except EngineDead as exc:
                raise APIError(500, f"the engine failed: {exc}", None, "server_error") from None
            if outs:
                yield outs

    def _take(self, handle: RequestHandle, choices: list[Choice], out: RequestOutput, want_lp):
        """File one output on its choice; returns (choice index, new text or None if the
        choice had already ended)."""
        i = handle.index[out.request_id]
        c = choices[i]
        if c.finish_reason is not None:
            return i, None
        new = out.new_token_ids
        c.token_ids += new
        c.num_tokens = out.num_tokens - len(out.prompt_token_ids)
        if want_lp and out.logprobs is not None:
            first = c.num_tokens - len(new)
            c.logprobs += [(t, out.logprobs[first + k]) for k, t in enumerate(new)]
        piece = c.detok.add(new, out.finished)
        if c.detok.stopped:
            c.finish_reason = "stop"
            if not out.finished:
                handle.end_early(out.request_id)
        elif out.finished:
            c.finish_reason = out.finish_reason
        return i, piece

    async def stream(self, handle, choices, want_lp, base, make_choice, usage_of):
        """The SSE chunks of a streamed response: one event per choice that has something new
        (make_choice(i, piece, choice) builds it, or None to send nothing), the events of one
        engine output batched into one write; then usage_of() if asked for, and [DONE]."""
        async for outs in self._outputs(handle):
            events = []
            for out in outs:
                i, piece = self._take(handle, choices, out, want_lp)
                if piece is None:
                    continue
                choice = make_choice(i, piece, choices[i])
                if choice is not None:
                    events.append(sse({**base, "choices": [choice]}))
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


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
