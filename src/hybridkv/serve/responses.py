"""Response bodies in OpenAI's shapes: completions and chat completions, whole or as
stream chunks, and the error body (`hybridkv.serve.schemas` documents each).

    completion        {"id": "cmpl-..", "object": "text_completion", "created", "model",
                       "choices": [{"index", "text", "logprobs", "finish_reason"}, ...],
                       "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
                                 "prompt_tokens_details": {"cached_tokens"}}}
    completion chunk  same object, one choice: {"index": k, "text": <delta>, ...}
    chat              "object": "chat.completion", choices[k].message {"role", "content"}
    chat chunk        "object": "chat.completion.chunk", choices[0].delta: first
                       {"role": "assistant", "content": ""} per choice, then
                       {"content": <delta>}
    usage chunk       (stream_options.include_usage) "choices": [], "usage": {...}
    error             {"error": {"message", "type", "param", "code"}}

Choice ``k`` answers sample ``k % n`` of prompt ``k // n``. Usage counts each prompt once
(however many samples), every choice's output, and as ``cached_tokens`` the prefix-cache
hit of each prompt's first sample (later samples hit what the first computed).
With ``echo`` a completion choice's text (and logprobs) start with its prompt. With
``return_token_ids`` (vLLM's extension) each choice also has ``token_ids`` (the new ones
in a chunk) and a whole response has ``prompt_token_ids`` (of the first prompt).

This module does not import torch.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridkv.errors import InvariantError, RequestError
from hybridkv.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from hybridkv.serve.prepare import Generation

if TYPE_CHECKING:
    from hybridkv.serve.engine_loop import Output


def error_body(err: RequestError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    }


def usage(
    num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0
) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


@dataclass
class _Choice:
    """What one choice sent so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprob_pairs: list[tuple[int, Any]] = field(default_factory=list)
    offset: int = 0  # completions text_offset after the logprobs sent
    started: bool = False
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class ResponseFormat:
    """Builds the bodies of one response (one id, one creation time): feed every
    `Output` to `add`, which returns the stream chunk for it."""

    def __init__(self, chat: bool, model: str, gen: Generation, texts: TokenTexts) -> None:
        self.chat = chat
        self.model = model
        self.gen = gen
        self.texts = texts
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(gen.num_choices)]

    @property
    def _kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def role_chunks(self) -> list[dict[str, Any]]:
        """The first chunk of each choice of a chat stream (none for completions)."""
        if not self.chat:
            return []
        return [
            self._envelope(
                self._kind,
                [
                    {
                        "index": k,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for k in range(self.gen.num_choices)
        ]

    def add(self, event: Output) -> dict[str, Any] | None:
        """Record ``event``; its stream chunk (None when there is nothing to send)."""
        gen = self.gen
        choice = self.choices[event.index]
        text = event.text
        pairs: list[tuple[int, Any]] = []
        if not choice.started:
            choice.started = True
            if gen.echo:
                prompt = gen.choice_prompt(event.index)
                text = gen.prompt_texts[event.index // gen.n] + text
                if event.prompt_logprobs is not None:
                    pairs += list(zip(prompt, event.prompt_logprobs, strict=True))
        if event.logprobs is not None:
            pairs += list(zip(event.token_ids, event.logprobs, strict=True))
        choice.text.append(text)
        choice.token_ids.extend(event.token_ids)
        choice.logprob_pairs.extend(pairs)
        choice.finish_reason = event.finish_reason
        choice.num_output_tokens = event.num_output_tokens
        choice.num_cached_tokens = event.num_cached_tokens
        wants_logprobs = gen.logprobs is not None
        if not (text or event.finish_reason is not None or gen.return_token_ids or pairs):
            return None
        body: dict[str, Any] = {"index": event.index}
        if self.chat:
            body["delta"] = {"content": text} if text or event.finish_reason is None else {}
            body["logprobs"] = (
                chat_logprobs([lp for _, lp in pairs], self.texts) if wants_logprobs else None
            )
        else:
            body["text"] = text
            body["logprobs"] = None
            if wants_logprobs:
                body["logprobs"], choice.offset = completion_logprobs(
                    pairs, self.texts, choice.offset
                )
        body["finish_reason"] = event.finish_reason
        if gen.return_token_ids:
            body["token_ids"] = list(event.token_ids)
        return self._envelope(self._kind, [body])

    def check_invariants(self) -> None:
        """One record per choice; a finished choice has its counts; logprobs pair one
        token each (no more than the prompt and output hold)."""
        if len(self.choices) != self.gen.num_choices:
            raise InvariantError(
                f"{len(self.choices)} choice records for {self.gen.num_choices} choices"
            )
        for k, c in enumerate(self.choices):
            limit = len(self.gen.choice_prompt(k)) + c.num_output_tokens
            if len(c.logprob_pairs) > limit or len(c.token_ids) > c.num_output_tokens:
                raise InvariantError(
                    f"choice {k}: {len(c.logprob_pairs)} logprobs and {len(c.token_ids)} "
                    f"tokens for {c.num_output_tokens} output tokens"
                )
            if c.offset < 0 or (c.finish_reason is not None and not c.started):
                raise InvariantError(f"choice {k}: finished before it started")

    def usage(self) -> dict[str, Any]:
        gen = self.gen
        first = [self.choices[i * gen.n] for i in range(len(gen.prompts))]
        return usage(
            sum(len(p) for p in gen.prompts),
            sum(c.num_output_tokens for c in self.choices),
            sum(c.num_cached_tokens for c in first),
        )

    def usage_chunk(self) -> dict[str, Any]:
        body = self._envelope(self._kind, [])
        body["usage"] = self.usage()
        return body

    def whole(self) -> dict[str, Any]:
        """The non-streamed body (after every choice finished)."""
        choices = []
        for k, c in enumerate(self.choices):
            text = "".join(c.text)
            body: dict[str, Any] = {"index": k}
            if self.chat:
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["text"] = text
            body["logprobs"] = None
            if self.gen.logprobs is not None:
                if self.chat:
                    body["logprobs"] = chat_logprobs([lp for _, lp in c.logprob_pairs], self.texts)
                else:
                    body["logprobs"] = completion_logprobs(c.logprob_pairs, self.texts)[0]
            body["finish_reason"] = c.finish_reason
            if self.gen.return_token_ids:
                body["token_ids"] = list(c.token_ids)
            choices.append(body)
        out = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        out["usage"] = self.usage()
        if self.gen.return_token_ids:
            out["prompt_token_ids"] = list(self.gen.prompts[0])
        return out
