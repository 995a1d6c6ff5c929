"""Response bodies in OpenAI's shapes: completions and chat completions, whole or as
stream chunks, and the error body.

    completion        {"id": "cmpl-..", "object": "text_completion", "created", "model",
                       "choices": [{"index": 0, "text", "logprobs": null, "finish_reason"}],
                       "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}
    completion chunk  same object, "choices": [{"index": 0, "text": <delta>, ...}]
    chat              "object": "chat.completion", choices[0].message {"role", "content"}
    chat chunk        "object": "chat.completion.chunk", choices[0].delta: first
                       {"role": "assistant", "content": ""}, then {"content": <delta>}
    usage chunk       (stream_options.include_usage) "choices": [], "usage": {...}
    error             {"error": {"message", "type", "param", "code"}}

With ``return_token_ids`` (vLLM's extension) each choice also has ``token_ids`` (the new
ones in a chunk) and a whole response has ``prompt_token_ids``.

This module does not import torch.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from hybridkv.errors import RequestError


def error_body(err: RequestError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    }


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


class ResponseFormat:
    """Builds the bodies of one response (one id, one creation time)."""

    def __init__(self, chat: bool, model: str, return_token_ids: bool) -> None:
        self.chat = chat
        self.model = model
        self.return_token_ids = return_token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def role_chunk(self) -> dict[str, Any] | None:
        """The first chunk of a chat stream (None for completions)."""
        if not self.chat:
            return None
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(
        self, text: str, token_ids: Sequence[int], finish_reason: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": text} if text or finish_reason is None else {}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, [choice])

    def usage_chunk(self, num_prompt_tokens: int, num_output_tokens: int) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(kind, [])
        body["usage"] = usage(num_prompt_tokens, num_output_tokens)
        return body

    def whole(
        self,
        text: str,
        token_ids: Sequence[int],
        prompt_token_ids: Sequence[int],
        finish_reason: str | None,
        num_output_tokens: int,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage(len(prompt_token_ids), num_output_tokens)
        if self.return_token_ids:
            body["prompt_token_ids"] = list(prompt_token_ids)
        return body
