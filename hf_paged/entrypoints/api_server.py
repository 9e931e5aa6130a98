"""The FastAPI app: OpenAI routes over one Engine, with its limits and OpenAI-shaped errors.

build_app(engine, model_name, ..., adapters={served name: LoRA adapter}) returns the app: the
base model under model_name and each of the engine's PeftModel adapters under a name of its
own, chosen by a request's `model`. Its lifespan starts the engine loop thread on the
server's event loop and stops it at shutdown. Every error a client can cause is a JSON body
{"error": {"message", "type", "param", "code"}} with the status OpenAI uses (400 bad input,
401 API key, 404 unknown model or route, 413 body too large, 429 queue full); the server keeps
serving after any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hf_paged.entrypoints.engine_client import EngineProcess
from hf_paged.entrypoints.metrics import ServerMetrics
from hf_paged.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from hf_paged.entrypoints.serving import OpenAIServing
from hf_paged.entrypoints.serving_chat import ChatRun
from hf_paged.entrypoints.serving_completion import CompletionRun

MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt max_model_len allows


def _error(status: int, message: str, param=None, type_="invalid_request_error", code=None):
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class _RunStream(StreamingResponse):
    """SSE of one run; however the response ends (done, client gone, server stopping), the
    run's unfinished requests are aborted and their blocks freed."""

    def __init__(self, run) -> None:
        super().__init__(
            run.chunks(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


class Limits:
    """The API key (every route but /health) and the body size, checked before any route runs.
    A pure ASGI middleware: Starlette's BaseHTTPMiddleware would re-buffer every SSE chunk."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                bad = _error(401, "Incorrect API key provided", code="invalid_api_key")
                return await bad(scope, receive, send)
        limit = self.max_body_bytes
        too_large = _error(413, f"the body is larger than {limit} bytes")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > limit:
                return await too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body, more = b"", True  # chunked: read it here, counting, then hand it on
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _full_or_abort(request: Request, run):
    """A non-streamed run, aborted if the client goes away before it ends."""
    work = asyncio.ensure_future(run.full())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return JSONResponse(work.result())
        work.cancel()
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    finally:
        gone.cancel()
        run.close()


async def _admitted(serving: OpenAIServing, run):
    """The run, once the engine accepted its requests (an APIError if it refused them)."""
    try:
        await serving.admitted(run.handle)
    except BaseException:
        run.close()
        raise
    return run


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    # an unknown field first: that is the one the client most needs to hear about
    errors.sort(key=lambda e: e.get("type") != "extra_forbidden")
    e = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if e["type"] == "json_invalid":
        return _error(400, f"the body is not valid JSON: {e.get('ctx', {}).get('error', '')}")
    if e["type"] == "extra_forbidden":
        return _error(
            400, f"Unsupported field {param!r}: hf_paged's server does not implement it", param
        )
    if e["type"] == "missing":
        return _error(400, f"Missing required field {param!r}", param)
    return _error(400, f"{param}: {e.get('msg')}" if param else str(e.get("msg")), param)


def _check_adapters(front, model_name: str, adapters: dict[str, str]) -> None:
    if not adapters:
        return
    known = front.adapter_names
    missing = sorted(set(adapters.values()) - known)
    if missing:
        raise ValueError(
            f"adapters: {missing} are not LoRA adapters of the model ({sorted(known)})"
        )
    if model_name in adapters:
        raise ValueError(f"adapters: {model_name!r} is the base model's served name")


def build_app(
    engine,
    model_name: str,
    api_key: str | None = None,
    max_queued: int = 1024,
    max_body_bytes: int = MAX_BODY_BYTES,
    adapters: dict[str, str] | None = None,
    stream_interval_s: float | None = None,
) -> FastAPI:
    """engine: an Engine (served by an engine loop thread in this process: AsyncEngine) or an
    EngineProcess (the engine in a process of its own; it was given max_queued itself).
    stream_interval_s: the engine thread hands outputs to the HTTP side at most once per this
    many seconds per live stream (None: AsyncEngine's default; 0: after every step)."""
    adapters = dict(adapters or {})
    if isinstance(engine, EngineProcess):
        front = engine
    else:
        from hf_paged.entrypoints.async_engine import AsyncEngine

        pacing = {} if stream_interval_s is None else {"stream_interval_s": stream_interval_s}
        front = AsyncEngine(engine, max_queued=max_queued, **pacing)
    _check_adapters(front, model_name, adapters)
    serving = OpenAIServing(front, model_name, adapters)
    metrics = ServerMetrics(front, model_name)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        front.start()
        try:
            yield
        finally:
            front.shutdown()

    app = FastAPI(title="hf_paged", lifespan=lifespan)
    app.add_middleware(Limits, api_key=api_key, max_body_bytes=max_body_bytes)
    app.state.front, app.state.metrics = front, metrics

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), code=None)

    @app.get("/health")
    async def health():
        if not front.alive:
            return _error(503, f"the engine loop stopped: {front.error!r}", type_="server_error")
        return Response(status_code=200)

    def model_card(name: str) -> dict:
        card = {"id": name, "object": "model", "created": created, "owned_by": "hf_paged"}
        if name != model_name:  # a LoRA adapter on the base model (vLLM's fields)
            card["parent"] = model_name
        return {**card, "max_model_len": front.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in serving.model_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        serving.adapter_of(name)  # a 404 for an unknown name
        return model_card(name)

    @app.get("/metrics")
    async def prometheus():
        # Engine.stats() waits for a step in progress (one process): off the event loop
        body = await asyncio.to_thread(metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        serving.adapter_of(body.model)  # an unknown model is a 404 before anything else
        run = await _admitted(serving, CompletionRun(serving, body))
        return _RunStream(run) if body.stream else await _full_or_abort(request, run)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        serving.adapter_of(body.model)
        run = await _admitted(serving, ChatRun(serving, body))
        return _RunStream(run) if body.stream else await _full_or_abort(request, run)

    return app
