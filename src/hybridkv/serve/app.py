"""The FastAPI app: OpenAI-compatible routes over an `EngineLoop`.

    POST /v1/completions        prompt (text or ids) -> text; "stream": server-sent events
    POST /v1/chat/completions   messages (chat template) -> message; streaming too
    GET  /v1/models             the one served model
    GET  /health                200 while the engine thread runs, else 503
    GET  /metrics               Prometheus text (`hybridkv.serve.metrics`)

One request's life: parse and check the body (`protocol`, `prepare`: any problem is a
400 before the engine sees it) -> submit to the engine loop -> wait for `Accepted` (or
the engine's refusal, also a 400) -> stream `Output` events as
``data: {chunk}\\n\\n`` lines ending in ``data: [DONE]``, or gather them into one body.
If the client goes away first (a closed stream, or a disconnect while a non-streaming
request waits), the request is aborted in the engine, which frees its blocks.

Every error leaves as OpenAI's ``{"error": {"message", "type", "param", "code"}}``:
`RequestError` with its own status, any other `HybridKVError` as 400, unknown routes as
404 / 405, and a bug of ours as 500 (logged with its traceback).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from hybridkv.errors import HybridKVError, RequestError
from hybridkv.serve.engine_loop import Accepted, EngineLoop, Failed, Output, RequestHandle
from hybridkv.serve.metrics import CONTENT_TYPE, render
from hybridkv.serve.prepare import Generation, ModelInfo, prepare_chat, prepare_completion
from hybridkv.serve.protocol import ChatBody, CompletionBody, parse_body
from hybridkv.serve.responses import ResponseFormat, error_body

log = logging.getLogger("hybridkv.serve")


def build_app(engine: EngineLoop, info: ModelInfo) -> FastAPI:
    app = FastAPI(title="hybridkv", summary="OpenAI-compatible API on the hybridkv engine")
    _add_error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine loop stopped"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": info.name,
            "object": "model",
            "created": created,
            "owned_by": "hybridkv",
            "max_model_len": info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        snapshot = await asyncio.wrap_future(engine.call(engine.metrics))
        return PlainTextResponse(render(snapshot), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(await request.body(), CompletionBody)
        return await _generate(request, engine, prepare_completion(body, info), info, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(await request.body(), ChatBody)
        return await _generate(request, engine, prepare_chat(body, info), info, chat=True)

    return app


async def _generate(
    request: Request, engine: EngineLoop, gen: Generation, info: ModelInfo, chat: bool
) -> Response:
    fmt = ResponseFormat(chat, info.name, gen.return_token_ids)
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
        return await _whole(request, engine, handle, fmt, gen)
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
    role = fmt.role_chunk()
    if role is not None:
        yield _sse_line(role)
    while True:
        event = await handle.next_event()
        if isinstance(event, Failed):  # headers are gone: the error goes in the stream
            yield _sse_line(error_body(event.error))
            break
        if not isinstance(event, Output):
            continue
        if event.text or event.finish_reason is not None or gen.return_token_ids:
            yield _sse_line(fmt.chunk(event.text, event.token_ids, event.finish_reason))
        if event.finish_reason is not None:
            if gen.include_usage:
                yield _sse_line(fmt.usage_chunk(event.num_prompt_tokens, event.num_output_tokens))
            break
    yield "data: [DONE]\n\n"


async def _whole(
    request: Request,
    engine: EngineLoop,
    handle: RequestHandle,
    fmt: ResponseFormat,
    gen: Generation,
) -> Response:
    """Gather the request's outputs, or abort it when the client disconnects first."""
    gather = asyncio.ensure_future(_gather(handle))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not gather.done():
            engine.abort(handle)
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        text, ids, last = gather.result()
    finally:
        gather.cancel()
        gone.cancel()
    return JSONResponse(
        fmt.whole(text, ids, gen.prompt_token_ids, last.finish_reason, last.num_output_tokens)
    )


async def _gather(handle: RequestHandle) -> tuple[str, list[int], Output]:
    parts: list[str] = []
    ids: list[int] = []
    while True:
        event = await handle.next_event()
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Accepted):
            continue
        parts.append(event.text)
        ids.extend(event.token_ids)
        if event.finish_reason is not None:
            return "".join(parts), ids, event


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read: only that can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that repeats empty bodies must not spin us


def _add_error_handlers(app: FastAPI) -> None:
    def reply(err: RequestError) -> JSONResponse:
        return JSONResponse(error_body(err), status_code=err.status)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError) -> JSONResponse:
        return reply(err)

    @app.exception_handler(HybridKVError)
    async def hybridkv_error(request: Request, err: HybridKVError) -> JSONResponse:
        return reply(RequestError(str(err), code=type(err).__name__))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return reply(RequestError(str(err.detail), status=err.status_code, kind=kind))

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
