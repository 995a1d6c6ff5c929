"""The FastAPI app: OpenAI-compatible routes over an `EngineLoop`.

    POST /v1/completions        prompt(s) (text or ids) -> text; "stream": server-sent events
    POST /v1/chat/completions   messages (chat template) -> message; streaming too
    GET  /v1/models             the one served model
    GET  /v1/models/{id}        its card (404 for any other id)
    GET  /health                200 while the engine thread runs, else 503
    GET  /metrics               Prometheus text (`hybridkv.serve.metrics`)

One request's life: FastAPI parses the body into its model (`protocol`; any problem is
a 400 in OpenAI's error shape), `prepare` checks the rest (400 / 404) -> submit to the
engine loop -> wait for `Accepted` (or the engine's refusal, also a 400) -> stream
`Output` events as ``data: {chunk}\\n\\n`` lines ending in ``data: [DONE]``, or gather
them into one body. If the client goes away first (a closed stream, or a disconnect
while a non-streaming request waits), the request is aborted in the engine, which frees
its blocks.

``/openapi.json`` documents every route's request and response models (`schemas`),
the error shape of its 4xx / 5xx answers, ``/metrics`` as text/plain and streams as
text/event-stream; FastAPI's own 422 entries are removed (validation answers 400).

Every error leaves as OpenAI's ``{"error": {"message", "type", "param", "code"}}``:
`RequestError` with its own status, any other `HybridKVError` as 400, unknown routes as
404, a wrong method as 405 with ``Allow``, a body over ``max_body_bytes`` as 413 (code
``request_too_large``), and a bug of ours as 500 (logged with its traceback). ``HEAD``
answers on every GET route (`_HeadAsGet`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridkv.errors import HybridKVError, RequestError
from hybridkv.serve.engine_loop import EngineLoop, Failed, Output, RequestHandle
from hybridkv.serve.logprobs import TokenTexts
from hybridkv.serve.metrics import CONTENT_TYPE, render
from hybridkv.serve.prepare import Generation, ModelInfo, prepare_chat, prepare_completion
from hybridkv.serve.protocol import ChatBody, CompletionBody, validation_error
from hybridkv.serve.responses import ResponseFormat, error_body
from hybridkv.serve.schemas import (
    SSE,
    ChatCompletionResponse,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    error_responses,
)

log = logging.getLogger("hybridkv.serve")
MAX_BODY_BYTES = 32 << 20  # lists of token-id prompts are large; 32 MiB holds plenty
# OpenAI's error ``code`` for Starlette's own answers (unknown route, wrong method).
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def build_app(engine: EngineLoop, info: ModelInfo, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    # strict_content_type=False: a JSON body without a Content-Type header is still read
    app = FastAPI(
        title="hybridkv",
        summary="OpenAI-compatible API on the hybridkv engine",
        strict_content_type=False,
    )
    app.add_middleware(_BodyLimit, max_body_bytes=max_body_bytes)
    app.add_middleware(_HeadAsGet)  # outermost: HEAD is GET before anything else sees it
    _add_error_handlers(app)
    created = int(time.time())
    texts = TokenTexts(info.tokenizer)
    card = {
        "id": info.name,
        "object": "model",
        "created": created,
        "owned_by": "hybridkv",
        "max_model_len": info.max_model_len,
    }

    @app.get(
        "/health",
        response_model=Health,
        responses={503: {"model": Health, "description": "the engine loop stopped"}},
    )
    async def health() -> Response:
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine loop stopped"}, status_code=503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(404))
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != info.name:
            raise RequestError(
                f"model {model_id!r} is not served here; this server serves {info.name!r}",
                param="model",
                status=404,
                code="model_not_found",
                kind="not_found_error",
            )
        return card

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {
                "description": "Prometheus text exposition format 0.0.4",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **error_responses(503),
        },
    )
    async def metrics() -> Response:
        snapshot = await asyncio.wrap_future(engine.call(engine.metrics))
        return PlainTextResponse(render(snapshot), media_type=CONTENT_TYPE)

    generation_errors = error_responses(400, 404, 413, 500, 503)

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={
            200: {"content": SSE, "description": "a completion, or a stream"},
            **generation_errors,
        },
    )
    async def completions(body: CompletionBody, request: Request) -> Response:
        gen = prepare_completion(body, info)
        return await _generate(request, engine, gen, ResponseFormat(False, info.name, gen, texts))

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={
            200: {"content": SSE, "description": "a chat completion, or a stream"},
            **generation_errors,
        },
    )
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        gen = prepare_chat(body, info)
        return await _generate(request, engine, gen, ResponseFormat(True, info.name, gen, texts))

    _document_truthfully(app, info.name)
    return app


def _document_truthfully(app: FastAPI, model_name: str) -> None:
    """``/openapi.json`` without FastAPI's 422 entries (validation answers 400 here), and
    with the one model id a body may name (any other is a 404)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            for body in ("CompletionBody", "ChatBody"):
                field = components.get(body, {}).get("properties", {}).get("model")
                if field is not None:
                    field["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _generate(
    request: Request, engine: EngineLoop, gen: Generation, fmt: ResponseFormat
) -> Response:
    handle = RequestHandle(gen, asyncio.get_running_loop())
    engine.submit(handle)
    handed_off = False
    try:
        first = await handle.next_event()
        if isinstance(first, Failed):
            raise first.error
        if gen.stream:
            handed_off = True
            return _EngineStream(_sse(handle, fmt, gen), lambda: _abort(engine, handle))
        return await _whole(request, engine, handle, fmt)
    finally:
        if not handed_off:
            _abort(engine, handle)


def _abort(engine: EngineLoop, handle: RequestHandle) -> None:
    if not handle.finished:
        engine.abort(handle)


class _EngineStream(StreamingResponse):
    """A stream that aborts its request however it ends (client gone, cancelled, done)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse_line(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _sse(handle: RequestHandle, fmt: ResponseFormat, gen: Generation) -> AsyncIterator[str]:
    for chunk in fmt.role_chunks():
        yield _sse_line(chunk)
    while not handle.finished:
        event = await handle.next_event()
        if isinstance(event, Failed):  # headers are gone: the error goes in the stream
            yield _sse_line(error_body(event.error))
            break
        if not isinstance(event, Output):
            continue
        body = fmt.add(event)
        if body is not None:
            yield _sse_line(body)
        if handle.finished and gen.include_usage:
            yield _sse_line(fmt.usage_chunk())
    yield "data: [DONE]\n\n"


async def _whole(
    request: Request, engine: EngineLoop, handle: RequestHandle, fmt: ResponseFormat
) -> Response:
    """Gather the request's outputs, or abort it when the client disconnects first."""
    gather = asyncio.ensure_future(_gather(handle, fmt))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not gather.done():
            engine.abort(handle)
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        gather.result()
    finally:
        gather.cancel()
        gone.cancel()
    return JSONResponse(fmt.whole())


async def _gather(handle: RequestHandle, fmt: ResponseFormat) -> None:
    while not handle.finished:
        event = await handle.next_event()
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Output):
            fmt.add(event)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read: only that can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that repeats empty bodies must not spin us


def _add_error_handlers(app: FastAPI) -> None:
    def reply(err: RequestError, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(err), status_code=err.status, headers=headers)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError) -> JSONResponse:
        return reply(err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        return reply(validation_error(err.errors(), prefix=("body",)))

    @app.exception_handler(HybridKVError)
    async def hybridkv_error(request: Request, err: HybridKVError) -> JSONResponse:
        return reply(RequestError(str(err), code=type(err).__name__))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if isinstance(err, _BodyTooLarge):
            return reply(err.error)
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        code = HTTP_CODES.get(err.status_code)
        # 405 keeps Starlette's Allow header (RFC 9110: a 405 must list the methods).
        return reply(
            RequestError(str(err.detail), status=err.status_code, kind=kind, code=code),
            err.headers,
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.error("internal error on %s", request.url.path, exc_info=err)
        return reply(
            RequestError(
                f"internal error: {type(err).__name__}: {err}",
                status=500,
                kind="server_error",
                code="internal_error",
            )
        )


class _BodyTooLarge(StarletteHTTPException):
    """A body found over the limit while it streams in. An HTTP exception because FastAPI
    turns any other error raised while reading a body into a 400 "There was an error
    parsing the body"; ``error`` is the answer `_add_error_handlers` sends."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


class _BodyLimit:
    """ASGI middleware: a body over ``max_body_bytes`` is a 413 (by its Content-Length
    before anything is read, or as it streams in)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _too_large(self, num_bytes: int | None) -> RequestError:
        limit = f"{self.max_body_bytes} bytes ({self.max_body_bytes / (1 << 20):g} MiB)"
        size = "over" if num_bytes is None else f"{num_bytes} bytes, over"
        return RequestError(
            f"the request body is {size} this server's limit of {limit}; send fewer or "
            "shorter prompts per request (split a batch into several requests)",
            status=413,
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            err = self._too_large(int(declared))
            await JSONResponse(error_body(err), status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge(self._too_large(None))
            return message

        await self.app(scope, limited, send)


class _HeadAsGet:
    """ASGI middleware: ``HEAD`` on a GET route answers what ``GET`` would, headers only
    (RFC 9110: a server should support HEAD wherever it supports GET); monitoring and
    benchmark clients (AIPerf) probe ``HEAD /metrics`` before they start. Any other
    route answers as GET does there (404, or 405 with ``Allow`` on POST routes)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":  # Content-Length stays GET's
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
