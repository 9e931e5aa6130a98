"""POST /v1/chat/completions: the messages through the chat template, returned whole or
streamed as SSE chunks (a role delta first, then content deltas, then the finish reason)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from hf_paged.entrypoints.protocol import ChatCompletionRequest
from hf_paged.entrypoints.serving import OpenAIServing


class ChatRun:
    """Validates and submits in the constructor (an APIError before any response starts)."""

    def __init__(self, serving: OpenAIServing, body: ChatCompletionRequest) -> None:
        self.serving, self.body = serving, body
        self.prompts = [serving.chat_prompt(body)]
        self.num_logprobs = body.num_logprobs
        params = serving.params(body, self.prompts, body.requested_max_tokens, self.num_logprobs)
        self.handle = serving.submit(self.prompts, params, body.model)
        self.choices = serving._choices(self.handle, body.stop)
        self.head = serving.head("chat", body.model)

    def close(self) -> None:
        self.handle.close()

    def _logprobs(self, entries) -> dict | None:
        if self.num_logprobs is None:
            return None
        return self.serving.chat_logprobs(entries, self.num_logprobs)

    async def full(self) -> dict:
        s, choices = self.serving, self.choices
        await s.run_full(self.handle, choices, self.num_logprobs is not None)
        texts = s.finish_texts(choices, self.body.stop)
        return {
            **self.head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self._logprobs(c.logprobs),
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
        s, choices = self.serving, self.choices
        base = {**self.head, "object": "chat.completion.chunk"}
        want_lp = self.num_logprobs is not None

        def choice(i, piece, c):
            delta = {}
            if not c.started:  # OpenAI's first delta of a choice names the role
                c.started = True
                delta["role"] = "assistant"
                delta["content"] = ""
            if piece:
                delta["content"] = piece
            if not delta and c.finish_reason is None and not c.logprobs:
                return None
            logprobs = self._logprobs(c.logprobs)
            c.logprobs = []
            return {
                "index": i,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }

        async for chunk in s.stream(self.handle, choices, want_lp, base, choice, self._usage):
            yield chunk
