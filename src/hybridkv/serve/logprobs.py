"""Engine logprobs (`engine.sampling.logprobs.TokenLogprob`) in OpenAI's two response shapes.

completions (``logprobs: k``), one entry per token of the choice's text (with ``echo``,
the prompt's tokens first; the first prompt token has no logprob: null)::

    {"tokens": ["def", " main"], "token_logprobs": [null, -1.2],
     "top_logprobs": [null, {" main": -1.2, " foo": -2.3}], "text_offset": [0, 3]}

``top_logprobs`` holds the k most likely tokens plus the scored token itself (vLLM
does the same, so ``max(top.values())`` is the top-1 logprob: lm-eval's "is greedy"
test). ``text_offset``: running sum of the token strings' lengths (as vLLM), which is
the token's character offset in the text for tokens that decode on their own.

chat (``logprobs: true, top_logprobs: k``)::

    {"content": [{"token": "def", "logprob": -0.1, "bytes": [100, 101, 102],
                  "top_logprobs": [{"token", "logprob", "bytes"}, ... k of them]}]}

A token's string is its decoded text (special tokens by name). One that is not valid
text on its own (part of a UTF-8 character) is ``"bytes:\\xNN"`` for a byte tokenizer
(OpenAI's spelling) and ``"token_id:N"`` otherwise (vLLM's), so distinct tokens never
share a key of the ``top_logprobs`` dict.

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hybridkv.errors import InvariantError

if TYPE_CHECKING:
    from hybridkv.engine.sampling.logprobs import TokenLogprob

INCOMPLETE_CHAR = "\ufffd"


class TokenTexts:
    """Token id -> display string and UTF-8 bytes (module doc), cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._bytes_layout = getattr(tokenizer, "name", None) == "bytes"
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        if self._tokenizer is None:
            out = f"token_id:{token_id}"
        else:
            out = str(self._tokenizer.decode([token_id], skip_special_tokens=False))
            if INCOMPLETE_CHAR in out or not out:
                out = (
                    f"bytes:\\x{token_id:02x}"
                    if self._bytes_layout and 0 <= token_id < 256
                    else f"token_id:{token_id}"
                )
        self._cache[token_id] = out
        return out

    def check_invariants(self) -> None:
        """Every string given out is non-empty text (no half character); with the byte
        tokenizer distinct ids never share one (they key the ``top_logprobs`` dict)."""
        bad = [t for t, text in self._cache.items() if not text or INCOMPLETE_CHAR in text]
        if bad:
            raise InvariantError(f"token ids {bad[:5]} have an empty or partial string")
        if self._bytes_layout and len(set(self._cache.values())) != len(self._cache):
            raise InvariantError("two byte-tokenizer ids have the same display string")

    def bytes(self, token_id: int) -> list[int] | None:
        if self._bytes_layout and 0 <= token_id < 256:
            return [token_id]
        text = self.text(token_id)
        if text.startswith(("bytes:", "token_id:")):
            return None
        return list(text.encode("utf-8"))


def completion_logprobs(
    pairs: Sequence[tuple[int, TokenLogprob | None]], texts: TokenTexts, start_offset: int = 0
) -> tuple[dict[str, Any], int]:
    """(the completions ``logprobs`` object of ``pairs``, the text offset after them).
    ``pairs``: (token id, its logprob, None for an unscored token: the first prompt one)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = start_offset
    for token_id, item in pairs:
        token = texts.text(token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if item is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(item.logprob)
        top = {texts.text(t): v for t, v in item.top}
        top.setdefault(token, item.logprob)
        tops.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, offset


def chat_logprobs(items: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``items``."""
    content = []
    for item in items:
        content.append(
            {
                "token": texts.text(item.token_id),
                "logprob": item.logprob,
                "bytes": texts.bytes(item.token_id),
                "top_logprobs": [
                    {"token": texts.text(t), "logprob": v, "bytes": texts.bytes(t)}
                    for t, v in item.top
                ],
            }
        )
    return {"content": content}
