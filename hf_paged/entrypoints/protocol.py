"""The OpenAI request bodies the server accepts, and their SamplingParams.

Every field OpenAI defines is either implemented or refused by name (a 400 naming it), never
silently ignored. A field that is absent, null, or set to the value that means "off" (say
`logit_bias: {}`) asks for nothing, so it passes. A few vLLM extensions that map straight onto
SamplingParams (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids) are
accepted too. Structured output: OpenAI's `response_format` (json_schema, json_object) and
vLLM's guided_json / guided_regex / guided_choice / guided_grammar (one per request).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hf_paged.sampling_params import SamplingParams
from hf_paged.structured_output import StructuredOutputs

# vLLM's guided decoding fields -> StructuredOutputs fields
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}

# Fields OpenAI defines that hf_paged does not implement, with the values that ask for nothing
# (these pass; any other value is a 400 naming the field).
NO_OP_VALUES: dict[str, tuple] = {
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "store": (False,),
    "parallel_tool_calls": (True, False),  # without tools it changes nothing
    "tool_choice": ("none",),
    "tools": ([],),
    "functions": ([],),
    "metadata": ({},),
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
}
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (chat top_logprobs, completions logprobs)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Base(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own records: nothing to do
    best_of: int | None = None
    # vLLM's extensions, as SamplingParams has them
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # structured output (hf_paged.structured_output)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_no_op_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = {}
        for key, value in data.items():
            if key not in cls.model_fields and (
                value is None or any(value == v for v in NO_OP_VALUES.get(key, ()))
            ):
                continue  # asks for nothing
            out[key] = value
        return out

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None:
            if len(stops) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}")
            if not all(stops):
                raise ValueError("stop sequences must be non-empty strings")
        return stops or None

    @model_validator(mode="after")
    def _check_common(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n (or unset) is supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, adapter: str | None = None
    ) -> SamplingParams:
        """The engine's options for this body (adapter: the LoRA adapter its `model` names).
        Raises ValueError naming the field."""
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            n=self.n,
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            stop_strings=self.stop,
            logprobs=logprobs,
            structured=self.structured_outputs(),
            adapter=adapter,
        )

    def structured_outputs(self) -> StructuredOutputs | None:
        """The body's constraint, parsed (a bad one raises ValueError naming its field)."""
        given = {k: f for k, f in GUIDED_FIELDS.items() if getattr(self, k) is not None}
        fmt = self.response_format
        if fmt is not None and fmt.get("type") != "text":
            given["response_format"] = None
        if len(given) > 1:
            raise ValueError(f"{', '.join(sorted(given))}: one structured output field at a time")
        if not given:
            return None
        ((name, kind),) = given.items()
        try:
            if name == "response_format":
                constraint = _response_format(fmt)
            else:
                constraint = StructuredOutputs(**{kind: getattr(self, name)})
            constraint.grammar_object()
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return constraint

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Base):
    """POST /v1/completions. prompt: a string, a list of strings, a list of token ids, or a
    list of lists of token ids; n choices per prompt (choice index = prompt * n + sample)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Base):
    """POST /v1/chat/completions: messages through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI, still sent by clients
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _response_format(fmt: dict) -> StructuredOutputs:
    """OpenAI's response_format: {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError('json_schema must be an object with a "schema" object')
        return StructuredOutputs(json=spec["schema"])
    raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """An error the client gets in OpenAI's shape with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type_,
            code,
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)
