"""From a checked request body to what the engine loop runs: prompt token ids, sampling
parameters, stop strings, and the length check against ``max_model_len``.

    prompt ids (P)      + max_tokens (M)        <= max_model_len (L)
    |<------ P ------>|<------- M ------->|
    P >= L  -> 400 on "prompt";  P + M > L -> 400 on "max_tokens" (names P, M and L);
    no max_tokens on a chat body -> M = L - P (generate until EOS or the limit).

This module does not import torch.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.errors import RequestError
from hybridkv.serve.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    ChatBody,
    CompletionBody,
    check_common,
    completion_prompt,
    stop_strings,
)


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side knows of the served model (fixed at startup; read from any
    thread). ``encode`` is `LLM.encode` (text -> ids as `LLM.generate` sees them);
    ``render_chat`` turns messages into prompt ids (`hybridkv.serve.chat`)."""

    name: str
    max_model_len: int
    vocab_size: int
    encode: Callable[[str], list[int]]
    render_chat: Callable[[list[dict[str, str]]], list[int]]


@dataclass(frozen=True)
class Generation:
    """One request as the engine loop runs it."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    seed: int
    ignore_eos: bool
    stop: tuple[str, ...]
    cache_salt: str | None
    stream: bool
    include_usage: bool
    return_token_ids: bool = False


def prepare_completion(body: CompletionBody, info: ModelInfo) -> Generation:
    check_common(body)
    check_model(body.model, info)
    prompt = completion_prompt(body.prompt)
    ids = info.encode(prompt) if isinstance(prompt, str) else prompt
    if isinstance(prompt, str) and not ids:
        raise RequestError("prompt encodes to 0 tokens", param="prompt", code="invalid_value")
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    return _generation(body, ids, max_tokens, "max_tokens", info)


def prepare_chat(body: ChatBody, info: ModelInfo) -> Generation:
    check_common(body)
    check_model(body.model, info)
    if not body.messages:
        raise RequestError("messages is empty", param="messages", code="invalid_value")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise RequestError(
            "give max_tokens or max_completion_tokens, not both",
            param="max_completion_tokens",
            code="invalid_value",
        )
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    ids = info.render_chat(messages)
    param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = (
        body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    )
    if max_tokens is None:
        max_tokens = max(1, info.max_model_len - len(ids))
    return _generation(body, ids, max_tokens, param, info)


def check_model(model: str | None, info: ModelInfo) -> None:
    if model is not None and model != info.name:
        raise RequestError(
            f"model {model!r} is not served here; this server serves {info.name!r} "
            "(GET /v1/models)",
            param="model",
            status=404,
            code="model_not_found",
        )


def _generation(
    body: CompletionBody | ChatBody,
    ids: list[int],
    max_tokens: int,
    param: str,
    info: ModelInfo,
) -> Generation:
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise RequestError(
            f"prompt token ids {bad[:5]} are outside the vocabulary 0..{info.vocab_size - 1}",
            param="prompt",
            code="invalid_value",
        )
    limit = info.max_model_len
    if len(ids) >= limit:
        raise RequestError(
            f"the prompt has {len(ids)} tokens; this model's max_model_len is {limit}, which "
            "must also hold at least one generated token. Shorten the prompt (or start the "
            "server with a larger --max-model-len)",
            param="messages" if isinstance(body, ChatBody) else "prompt",
            code="context_length_exceeded",
        )
    if len(ids) + max_tokens > limit:
        raise RequestError(
            f"{len(ids)} prompt tokens + {param}={max_tokens} = {len(ids) + max_tokens} "
            f"exceeds max_model_len {limit}; lower {param} to at most {limit - len(ids)}",
            param=param,
            code="context_length_exceeded",
        )
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    # Without a seed a sampled request draws its own (greedy output does not use it).
    seed = body.seed if body.seed is not None else secrets.randbits(62)
    return Generation(
        prompt_token_ids=tuple(ids),
        max_tokens=max_tokens,
        temperature=float(temperature),
        seed=seed,
        ignore_eos=body.ignore_eos,
        stop=stop_strings(body.stop),
        cache_salt=body.cache_salt,
        stream=body.stream,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        return_token_ids=body.return_token_ids,
    )
