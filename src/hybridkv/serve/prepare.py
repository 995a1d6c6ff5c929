"""From a checked request body to what the engine loop runs: prompts as token ids, the
choices, sampling parameters, stop strings, and the length check against
``max_model_len``.

    prompt ids (P)      + max_tokens (M)        <= max_model_len (L)
    |<------ P ------>|<------- M ------->|
    P >= L  -> 400 on "prompt";  P + M > L -> 400 on "max_tokens" (names P, M and L);
    no max_tokens on a chat body -> M = L - P (generate until EOS or the limit).

Choices: ``k = i * n + j`` is sample ``j`` of prompt ``i`` (OpenAI's and vLLM's order);
sample ``j`` draws from the random stream ``(seed, j)`` (`engine.sampling.sampler.make_generator`),
so each prompt's n samples differ and a seed repeats them.

``max_tokens: 0`` with ``echo`` (a loglikelihood request) runs the engine for one token
and drops it: the answer holds the prompt and its logprobs only.

This module does not import torch.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.errors import RequestError
from hybridkv.serve.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    MAX_CHOICES,
    MIN_SAMPLING_TEMPERATURE,
    ChatBody,
    CompletionBody,
    check_common,
    completion_prompts,
    stop_strings,
)


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side knows of the served model (fixed at startup; read from any
    thread). ``encode`` is `LLM.encode` (text -> ids as `LLM.generate` sees them);
    ``render_chat`` turns messages into prompt ids (`hybridkv.serve.chat`); ``decode``
    turns ids into text (echo of id prompts)."""

    name: str
    max_model_len: int
    vocab_size: int
    encode: Callable[[str], list[int]]
    render_chat: Callable[[list[dict[str, str]]], list[int]]
    decode: Callable[[Sequence[int]], str] = lambda ids: ""
    tokenizer: Any = None  # token strings of logprobs (`serve.logprobs.TokenTexts`)


@dataclass(frozen=True)
class Generation:
    """One HTTP request as the engine loop runs it: ``len(prompts) * n`` choices.
    ``sampling``: keyword arguments of `engine.sampling.sampler.SamplingParams` besides
    ``max_new_tokens``, ``seed`` and the logprob counts."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int  # 0: echo only (module doc)
    temperature: float
    seed: int
    ignore_eos: bool
    stop: tuple[str, ...]
    cache_salt: str | None
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    n: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None  # per output token: the top-k (0: the chosen one only)
    echo: bool = False  # completions: the prompt text and logprobs lead each choice
    prompt_texts: tuple[str, ...] = ()  # for echo, one per prompt

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choice_prompt(self, index: int) -> tuple[int, ...]:
        return self.prompts[index // self.n]

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The first prompt (the only one of a chat request)."""
        return self.prompts[0]


def prepare_completion(body: CompletionBody, info: ModelInfo) -> Generation:
    check_common(body)
    check_model(body.model, info)
    prompts = completion_prompts(body.prompt)
    encoded = []
    for prompt in prompts:
        ids = info.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt encodes to 0 tokens", param="prompt", code="invalid_value")
        encoded.append(ids)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    texts = tuple(p if isinstance(p, str) else info.decode(p) for p in prompts)
    return _generation(
        body, encoded, max_tokens, "max_tokens", info, body.logprobs, body.echo, texts
    )


def prepare_chat(body: ChatBody, info: ModelInfo) -> Generation:
    check_common(body)
    check_model(body.model, info)
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
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _generation(body, [ids], max_tokens, param, info, logprobs, False, ())


def check_model(model: str | None, info: ModelInfo) -> None:
    if model is not None and model != info.name:
        raise RequestError(
            f"model {model!r} is not served here; this server serves {info.name!r} "
            "(GET /v1/models)",
            param="model",
            status=404,
            code="model_not_found",
        )


def _check_length(ids: list[int], max_tokens: int, param: str, chat: bool, info: ModelInfo) -> None:
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
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    if len(ids) + max_tokens > limit:
        raise RequestError(
            f"{len(ids)} prompt tokens + {param}={max_tokens} = {len(ids) + max_tokens} "
            f"exceeds max_model_len {limit}; lower {param} to at most {limit - len(ids)}",
            param=param,
            code="context_length_exceeded",
        )


def _generation(
    body: CompletionBody | ChatBody,
    prompts: list[list[int]],
    max_tokens: int,
    param: str,
    info: ModelInfo,
    logprobs: int | None,
    echo: bool,
    texts: tuple[str, ...],
) -> Generation:
    num_choices = len(prompts) * body.n
    if num_choices > MAX_CHOICES:
        raise RequestError(
            f"{len(prompts)} prompts x n={body.n} = {num_choices} choices; this server "
            f"answers at most {MAX_CHOICES} per request: split the request",
            param="n" if body.n > 1 else "prompt",
            code="invalid_value",
        )
    for ids in prompts:
        _check_length(ids, max_tokens, param, isinstance(body, ChatBody), info)
    if body.min_tokens > max(max_tokens, 0):
        raise RequestError(
            f"min_tokens={body.min_tokens} exceeds {param}={max_tokens}; lower min_tokens",
            param="min_tokens",
            code="invalid_value",
        )
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    if temperature < MIN_SAMPLING_TEMPERATURE:
        temperature = 0.0
    # Without a seed a sampled request draws its own (greedy output does not use it).
    seed = body.seed if body.seed is not None else secrets.randbits(62)
    sampling: dict[str, Any] = {"min_tokens": body.min_tokens}
    for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            sampling[name] = float(value)
    if body.top_k is not None and body.top_k > 0:
        sampling["top_k"] = body.top_k
    return Generation(
        prompts=tuple(tuple(ids) for ids in prompts),
        max_tokens=max_tokens,
        temperature=float(temperature),
        seed=seed,
        ignore_eos=body.ignore_eos,
        stop=stop_strings(body.stop),
        cache_salt=body.cache_salt,
        stream=body.stream,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        return_token_ids=body.return_token_ids,
        n=body.n,
        sampling=sampling,
        logprobs=logprobs,
        echo=echo,
        prompt_texts=texts,
    )
