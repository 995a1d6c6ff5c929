"""Response models: what ``/openapi.json`` says each route answers. The routes build
their bodies as dicts (`hybridkv.serve.responses`); these models document them, and
tests validate real answers against them. Optional fields not always present
(``usage`` in chunks, vLLM's ``token_ids``) are not required.

This module does not import torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, server_error")
    param: str | None = Field(description="the offending field, null for the whole body")
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every 4xx and 5xx answer."""

    error: ErrorDetail


class Health(BaseModel):
    status: str = Field(description='"ok", or why the engine loop is not running (503)')


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


class CompletionResponse(BaseModel):
    """A whole completion (also each ``data:`` chunk of a stream, one choice per chunk;
    a last chunk with ``usage`` and no choices when ``stream_options.include_usage``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


class ChatCompletionResponse(BaseModel):
    """A whole chat completion (streams send ``chat.completion.chunk`` objects with a
    ``delta`` instead of ``message``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries documenting ``statuses`` with `ErrorResponse`."""
    what = {
        400: "invalid request (OpenAI's error shape; param names the field)",
        404: "unknown model or route",
        405: "method not allowed (the Allow header lists the allowed ones)",
        413: "request body too large",
        500: "internal error",
        503: "the engine loop is not running",
    }
    return {s: {"model": ErrorResponse, "description": what[s]} for s in statuses}


SSE: dict[str, Any] = {"text/event-stream": {"schema": {"type": "string"}}}
