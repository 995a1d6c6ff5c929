"""Request bodies of the OpenAI-compatible API, and their checks.

A body goes through two gates, both ending in `RequestError` (HTTP 400, OpenAI's
``{"error": {"message", "type", "param", "code"}}``), never a 500:

    JSON text --parse_body--> dict --pydantic (strict, unknown keys refused)--> model
    model --check_common--> semantic checks (n = 1, finite temperature >= 0, stop strings,
                            OpenAI options we accept only at their no-op defaults)

Strict typing: ``"max_tokens": "5"``, ``1.5`` or ``true`` are refused, not coerced; a
float field takes an integer. Options we do not implement (``top_p``, penalties,
``logprobs``, ``echo``, ``best_of``, ``logit_bias``) are accepted only at the value that
means "off", so a client that sends the defaults works and one that relies on them is
told. Length limits need the tokenizer and live in `hybridkv.serve.prepare`.

This module does not import torch.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from hybridkv.errors import RequestError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy (token-exact) output


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: Any = None  # str | list[str]; checked by hand for a clear message
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's extension: keep going past the EOS id
    return_token_ids: bool = False  # vLLM's extension: token ids beside the text
    user: str | None = None  # accepted and ignored, as OpenAI uses it for abuse tracking
    # Accepted only at their "off" value (module doc).
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Sampling):
    prompt: Any = None  # str | list[int] | [str] | [list[int]]; checked by hand
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatBody(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None


def parse_body(raw: bytes, model: type[_Body]) -> Any:
    """``raw`` JSON as ``model``; `RequestError` naming the field otherwise."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # ValueError: bad JSON, bad UTF-8, huge ints
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise RequestError(f"the body is not valid JSON: {reason}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(
            f"the body must be a JSON object, got {type(data).__name__}", code="invalid_type"
        )
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part)) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        if first["type"] == "extra_forbidden":
            message = f"unknown or unsupported field {param!r}"
        elif first["type"] == "missing":
            message = f"missing required field {param!r}"
        else:
            shown = repr(first.get("input"))
            message += f" (got {shown[:60]}{'...' if len(shown) > 60 else ''})"
        raise RequestError(message, param=param, code=first["type"]) from None


def _is_union_tag(part: int | str) -> bool:
    """Whether a pydantic error location part names a union member ("str",
    "list[TextPart]") rather than a field or an index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def check_common(body: _Sampling) -> None:
    """Semantic checks every generation body passes (module doc)."""
    if body.n != 1:
        raise RequestError(
            f"n={body.n}: this server returns one choice per request; send n=1 (or omit "
            "it) and repeat the request for more samples",
            param="n",
            code="unsupported_value",
        )
    temperature = body.temperature
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise RequestError(
            f"temperature={temperature}: needs a finite number >= 0 (0 = greedy)",
            param="temperature",
            code="invalid_value",
        )
    if body.max_tokens is not None:
        check_max_tokens(body.max_tokens, "max_tokens")
    if body.cache_salt is not None and not body.cache_salt:
        raise RequestError(
            "cache_salt is empty; omit it or give a non-empty string",
            param="cache_salt",
            code="invalid_value",
        )
    stop_strings(body.stop)
    off: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "top_p": (body.top_p, (None, 1.0)),
        "presence_penalty": (body.presence_penalty, (None, 0.0)),
        "frequency_penalty": (body.frequency_penalty, (None, 0.0)),
        "logit_bias": (body.logit_bias, (None, {})),
    }
    if isinstance(body, CompletionBody):
        off |= {
            "echo": (body.echo, (False,)),
            "logprobs": (body.logprobs, (None,)),
            "best_of": (body.best_of, (None, 1)),
            "suffix": (body.suffix, (None,)),
        }
    if isinstance(body, ChatBody):
        if body.max_completion_tokens is not None:
            check_max_tokens(body.max_completion_tokens, "max_completion_tokens")
        off |= {
            "logprobs": (body.logprobs, (False,)),
            "top_logprobs": (body.top_logprobs, (None, 0)),
        }
    for name, (value, allowed) in off.items():
        if value not in allowed:
            raise RequestError(
                f"{name}={value!r} is not supported by this server; omit it or send "
                f"{allowed[-1]!r}",
                param=name,
                code="unsupported_value",
            )


def check_max_tokens(value: int, param: str) -> None:
    if value < 1:
        raise RequestError(
            f"{param}={value}: needs an integer >= 1", param=param, code="invalid_value"
        )


def stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` (None, a string or a list of strings) as a tuple of non-empty strings."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise RequestError(
            f"stop must be a string or a list of strings, got {stop!r}",
            param="stop",
            code="invalid_type",
        )
    if any(not s for s in items):
        raise RequestError("stop strings must not be empty", param="stop", code="invalid_value")
    return tuple(items)


def completion_prompt(prompt: Any) -> str | list[int]:
    """The one prompt of a completions body: a string, a list of token ids, or a list
    holding exactly one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", param="prompt", code="invalid_value")
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        if not prompt:
            raise RequestError("prompt has no token ids", param="prompt", code="invalid_value")
        return list(prompt)
    if prompt is None:
        raise RequestError("missing required field 'prompt'", param="prompt", code="missing")
    if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        raise RequestError(
            f"prompt holds {len(prompt)} prompts; this server takes one prompt per request",
            param="prompt",
            code="unsupported_value",
        )
    raise RequestError(
        "prompt must be a string, a list of integer token ids, or a list holding one of "
        f"those; got {type(prompt).__name__}",
        param="prompt",
        code="invalid_type",
    )
