"""POST /v1/completions: one run, returned whole or streamed as SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

from hf_paged.entrypoints.protocol import CompletionRequest
from hf_paged.entrypoints.serving import OpenAIServing


class CompletionRun:
    """Validates and submits in the constructor (an APIError before any response starts)."""

    def __init__(self, serving: OpenAIServing, body: CompletionRequest) -> None:
        self.serving, self.body = serving, body
        self.prompts = serving.completion_prompts(body)
        params = serving.params(body, self.prompts, body.max_tokens, body.logprobs)
        self.want_logprobs = body.logprobs is not None
        self.handle = serving.submit(self.prompts, params, body.model)
        self.choices = serving._choices(self.handle, body.stop)
        self.base = {**serving.head("cmpl", body.model), "object": "text_completion"}

    def close(self) -> None:
        self.handle.close()

    async def full(self) -> dict:
        s, choices = self.serving, self.choices
        await s.run_full(self.handle, choices, self.want_logprobs)
        texts = s.finish_texts(choices, self.body.stop)
        return {
            **self.base,
            "choices": [
                {
                    "index": i,
                    "text": text,
                    "logprobs": (
                        s.completion_logprobs(c.logprobs, c) if self.want_logprobs else None
                    ),
                    "finish_reason": c.finish_reason,
                }
                for i, (c, text) in enumerate(zip(choices, texts))
            ],
            "usage": s.usage(self.prompts, choices),
        }

    def _usage(self) -> dict | None:
        """The stream's closing usage chunk, when the request asked for one."""
        if not self.body.include_usage:
            return None
        return self.serving.usage(self.prompts, self.choices)

    async def chunks(self) -> AsyncIterator[str]:
        s, choices, base = self.serving, self.choices, self.base

        def choice(i, piece, c):
            if not piece and c.finish_reason is None and not c.logprobs:
                return None
            logprobs = None
            if self.want_logprobs:
                logprobs = s.completion_logprobs(c.logprobs, c)
                c.logprobs = []
            return {
                "index": i,
                "text": piece,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }

        async for chunk in s.stream(
            self.handle, choices, self.want_logprobs, base, choice, self._usage
        ):
            yield chunk
