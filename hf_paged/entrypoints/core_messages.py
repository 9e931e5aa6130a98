"""What the API process and the engine process say to each other (`hf-paged serve
--engine-process`), torch-free: both sides import it.

Two one-way pipes. API -> engine, one message each:
  (ADD, handle_id, request_ids, prompts, params)   queue prompts (token ids) under these ids
  (ABORT, request_ids)                             the client went away: end them, free blocks
  (CALL, call_id, name)                            introspection (tests): see CALLS
  (SHUTDOWN,)
Engine -> API: a list of items per message (the sender thread batches what queued up while the
pipe was busy, so a slow reader gets fewer, larger messages and never stalls a step):
  (READY, info) | (FAILED, traceback text)         once, at start-up
  (ACK, handle_id, None | error message)           an ADD queued, or refused (a ValueError)
  (OUTPUTS, [output tuple, ...], stats | None)     one step's outputs, all requests together
  (REPLY, call_id, ok, value)
  (DEAD, traceback text)                           a step raised: the engine serves no more

An output tuple is (request_id, new_token_ids, num_tokens, new_logprobs, end) with end None while
the request runs, else (finish_reason, index, arrival_time, first_token_time, finish_time):
token ids and a few numbers per request per step, pickled (pickle's C encoder beats any
per-field encoding here; the model never crosses, the child loads it from EngineSpec).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

ADD, ABORT, CALL, SHUTDOWN = "add", "abort", "call", "shutdown"
READY, FAILED, ACK, OUTPUTS, REPLY, DEAD = "ready", "failed", "ack", "outputs", "reply", "dead"
# CALL names: "stats" (Engine.stats() now), "idle" (whether requests are left; if none, the
# engine's invariants are checked and every KV block must be free)
CALLS = ("stats", "idle")


@dataclass(slots=True)
class EngineSpec:
    """How the engine process builds its Engine: load() -> (model, tokenizer) runs there (the
    model is loaded in that process, never pickled across); options are Engine's keyword
    arguments; setup(engine), if given, runs once before serving (a benchmark's warm-up).
    load and setup must be picklable: module-level functions or functools.partial of them."""

    load: Callable
    options: dict = field(default_factory=dict)
    setup: Callable | None = None


@dataclass(slots=True)
class CoreOutput:
    """One request's tokens since the API side last read it: RequestOutput's fields that the
    serving layer and the metrics read, rebuilt in the API process (no torch there)."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    num_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None  # the request's whole list, as RequestOutput
    index: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
