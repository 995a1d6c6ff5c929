"""Request bodies of the OpenAI-compatible API, and their checks.

A body goes through two gates, both ending in `RequestError` (HTTP 400, OpenAI's
``{"error": {"message", "type", "param", "code"}}``), never a 500:

    JSON text --FastAPI / parse_body--> dict --pydantic (strict, unknown keys refused,
                                               the bounds below)--> model
    model --check_common--> semantic checks (finite temperature, stop strings, the
                            total number of choices, options we accept only "off")

The models are the routes' body parameters, so ``/openapi.json`` documents them with
their bounds (`hybridkv.serve.app`). Strict typing: ``"max_tokens": "5"``, ``1.5`` or
``true`` are refused, not coerced; a float field takes an integer.

Supported with vLLM's semantics where OpenAI leaves room (docs/openai_api.md):
``n``, ``logprobs`` (completions: top-k; chat: ``logprobs`` + ``top_logprobs``),
``echo`` (prompt logprobs), ``max_tokens: 0`` with ``echo``, lists of prompts, ``top_p``,
``top_k``, ``min_p``, ``min_tokens``, the three penalties. Still accepted only at their
"off" value: ``best_of``, ``logit_bias``, ``suffix``. Length limits need the tokenizer
and live in `hybridkv.serve.prepare`.

This module does not import torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridkv.errors import RequestError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy (token-exact) output
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): logits / T would overflow.
MIN_SAMPLING_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01  # = engine.sampling.sampler's (this module does not import torch)
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20  # top logprobs per token (vLLM's default max_logprobs; OpenAI's chat cap)
MAX_CHOICES = 128  # prompts x n per request: one request must not flood the engine

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="a last chunk with the usage, no choices")


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="the served model's id (GET /v1/models)")
    max_tokens: int | None = Field(
        None, ge=0, description="completions: 16 by default; 0 only with echo"
    )
    temperature: float | None = Field(None, ge=0, description="1 by default; 0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling (1 = off)")
    top_k: int | None = Field(None, ge=-1, description="k most likely only (-1 or 0 = off)")
    min_p: float | None = Field(None, ge=0, le=1, description="relative to the top (0 = off)")
    min_tokens: int = Field(0, ge=0, description="stop ids and strings ignored before this")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, description="1 = off (vLLM)"
    )
    seed: int | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: NonEmptyStr | None = Field(None, description="isolates prefix-cache tenants")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices per prompt")
    ignore_eos: bool = Field(False, description="vLLM's extension: keep going past EOS")
    return_token_ids: bool = Field(False, description="vLLM's extension: token ids too")
    user: str | None = Field(None, description="accepted and ignored")
    logit_bias: dict[str, float] | None = Field(None, description="only {} (off)")


class CompletionBody(_Sampling):
    prompt: NonEmptyStr | TokenIds | list[NonEmptyStr] | list[TokenIds] = Field(
        description="a text, a list of token ids, or a list of either (one choice each)"
    )
    echo: bool = Field(False, description="prepend the prompt (and its logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top-k per token")
    best_of: int | None = Field(None, description="only 1 (off)")
    suffix: str | None = Field(None, description="only null (off)")


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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="newer max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs")


def parse_body(raw: bytes, model: type[_Body]) -> Any:
    """``raw`` JSON as ``model``; `RequestError` naming the field otherwise (the same
    checks FastAPI runs on a route's body, for callers outside the app)."""
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
        raise validation_error(err.errors(include_url=False)) from None


def validation_error(errors: Sequence[Any], prefix: tuple[str, ...] = ()) -> RequestError:
    """pydantic's ``errors`` as a `RequestError` naming the field (a union member's tag
    and the leading ``prefix``, e.g. FastAPI's "body", are not part of it) and saying
    what is wrong with the value: for a union, the error of the form the value was
    meant to take (`_intended`), e.g. a negative token id in a list of ids, not
    "should be a valid string" from the text form tried first."""
    first = _intended(errors)
    loc = list(first.get("loc", ()))[len(prefix) :]
    cut = next((i for i, part in enumerate(loc) if _is_union_tag(part)), len(loc))
    param = ".".join(str(part) for part in loc[:cut]) or None
    kind = str(first.get("type", "invalid_value"))
    where = (param or "") + "".join(f"[{part}]" for part in loc[cut + 1 :])
    value = first.get("input")
    if kind == "extra_forbidden":
        message = f"unknown or unsupported field {param!r}"
    elif kind == "missing":
        message = f"missing required field {param!r}" if param else "the request needs a body"
    elif kind == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        message, param = f"the body is not valid JSON: {reason}", None
    elif param is None and isinstance(value, bytes | bytearray):
        message = "the body must be JSON, sent with Content-Type: application/json"
    elif param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "the body must be a JSON object"
    elif param == "prompt" and kind == "greater_than_equal":
        message = f"{where} = {value!r} is a negative token id; token ids are integers >= 0"
    elif kind == "string_too_short":
        message = f"{where} is an empty string; it needs at least one character"
    elif kind == "too_short" and param == "prompt":
        message = f"{where} is an empty list; a prompt of token ids needs at least one id"
    elif param == "prompt" and cut < len(loc) and first is errors[0]:  # no form fits
        message = (
            "prompt must be a text, a list of token ids (integers >= 0), or a list of "
            f"texts or of token-id lists (got {_short(value)})"
        )
    else:
        message = f"{where}: {first.get('msg')}" if param else str(first.get("msg"))
        if cut < len(loc) and first is errors[0]:  # every union member refused it alike
            message += " (nor any other allowed form)"
        message += f" (got {_short(value)})"
    return RequestError(message, param=param, code=kind)


def _short(value: object) -> str:
    shown = repr(value)
    return f"{shown[:60]}{'...' if len(shown) > 60 else ''}"


def _intended(errors: Sequence[Any]) -> Any:
    """The error to report. A value of a union field (``prompt``: text, ids, texts or
    lists of ids) is refused once per member; the member it was meant as is the one
    whose errors are all about values, not types (``[1, -2]`` is a list of ids with a
    negative id, not a string). Otherwise the first error."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    cut = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if cut is None:
        return first
    by_member: dict[Any, list[Any]] = {}
    for error in errors:
        other = tuple(error.get("loc", ()))
        if other[:cut] == loc[:cut] and len(other) > cut:
            by_member.setdefault(other[cut], []).append(error)
    for member_errors in by_member.values():
        if all(not str(e.get("type", "")).endswith("_type") for e in member_errors):
            return member_errors[0]
    return first


def _is_union_tag(part: int | str) -> bool:
    """Whether a pydantic error location part names a union member ("str",
    "list[TextPart]", "constrained-str") rather than a field or an index."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or "[" in part or part.startswith("constrained")
    )


def check_common(body: CompletionBody | ChatBody) -> None:
    """Semantic checks every generation body passes (module doc)."""
    temperature = body.temperature
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise RequestError(
            f"temperature={temperature}: needs a finite number >= 0 (0 = greedy)",
            param="temperature",
            code="invalid_value",
        )
    for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None and not math.isfinite(value):
            raise RequestError(f"{name}={value}: needs a finite number", param=name)
    off: dict[str, tuple[Any, tuple[Any, ...]]] = {"logit_bias": (body.logit_bias, (None, {}))}
    if isinstance(body, CompletionBody):
        off |= {"best_of": (body.best_of, (None, 1)), "suffix": (body.suffix, (None,))}
        if body.max_tokens == 0 and not body.echo:
            raise RequestError(
                "max_tokens=0 returns nothing without echo; send echo=true (the prompt and "
                "its logprobs) or max_tokens >= 1",
                param="max_tokens",
                code="invalid_value",
            )
    if isinstance(body, ChatBody):
        if body.max_tokens == 0:
            raise RequestError(
                "max_tokens=0: a chat completion needs max_tokens >= 1",
                param="max_tokens",
                code="invalid_value",
            )
        if body.top_logprobs and not body.logprobs:
            raise RequestError(
                f"top_logprobs={body.top_logprobs} needs logprobs=true",
                param="top_logprobs",
                code="invalid_value",
            )
    for name, (value, allowed) in off.items():
        if value not in allowed:
            raise RequestError(
                f"{name}={value!r} is not supported by this server; omit it or send "
                f"{allowed[-1]!r}",
                param=name,
                code="unsupported_value",
            )


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """``stop`` (None, a string or a list of strings) as a tuple."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def completion_prompts(
    prompt: str | list[int] | list[str] | list[list[int]],
) -> list[str | list[int]]:
    """The prompts of a completions body: a text or a list of token ids is one prompt; a
    list of texts or of token-id lists is several (one choice each, times ``n``)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt is an empty list", param="prompt", code="invalid_value")
    if all(isinstance(t, int) for t in prompt):
        return [[int(t) for t in prompt if isinstance(t, int)]]
    return [p if isinstance(p, str) else list(p) for p in prompt if not isinstance(p, int)]
