"""Incremental text of one request: what to send after each engine step, and where a
stop string cuts it.

Each update decodes every output token so far (simple and right for byte-level and
most HF tokenizers; O(n) per step, fine for a reference engine) and sends the part of
the text that can no longer change:

    decoded    "def main():\\n    pri\\ufffd"      (the last token is half a UTF-8 char)
    held back  the trailing U+FFFD (an incomplete character) and, with stop strings,
               the longest end of the text that is the start of a stop string
    sent       everything before that, once; the concatenation of all sends is the
               final text

With ``stop=["\\n\\n"]`` and decoded "a\\nb\\n\\nc", the text ends at the first stop string:
final "a\\nb", finish reason "stop" (the engine request is then cancelled). The text
ends at the first update in which any stop string is complete, before the earliest
one present then (a step of several speculative tokens may complete several). A
tokenizer whose decoded prefix changes as tokens arrive (rare; some HF cleanup rules)
sends nothing further until the end, where the rest of the final text goes out.

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import InvariantError

INCOMPLETE_CHAR = "\ufffd"


def text_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """``ids -> text`` without special tokens (as OpenAI servers answer: no EOS marker in
    the text). `LLM.generate`'s ``text`` is the same for the byte tokenizer, which drops
    them anyway; a Hugging Face tokenizer's plain ``decode`` would keep them. Without a
    tokenizer the text is empty (``return_token_ids`` still gives the tokens)."""
    if tokenizer is None:
        return lambda ids: ""
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))


@dataclass(frozen=True)
class TextDelta:
    text: str  # new text to send (may be empty)
    stopped: bool  # a stop string was found: ``text`` ends just before it


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.sent = ""  # the text sent so far: always a prefix of the final text
        self.done = False

    def update(self, token_ids: Sequence[int], finished: bool) -> TextDelta:
        """The next delta for the output ``token_ids`` (all of them so far);
        ``finished``: the engine will emit no more tokens for this request."""
        if self.done:
            return TextDelta("", False)
        full = self._decode(token_ids)
        cut = self._first_stop(full)
        if cut is not None:
            self.done = True
            return self._send(full[:cut], stopped=True)
        if finished:
            self.done = True
            return self._send(full, stopped=False)
        safe = full.rstrip(INCOMPLETE_CHAR)
        safe = safe[: len(safe) - self._stop_prefix(safe)]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return TextDelta("", False)
        return self._send(safe, stopped=False)

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        for k in range(min(self._hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _send(self, upto: str, stopped: bool) -> TextDelta:
        delta = upto[len(self.sent) :] if upto.startswith(self.sent) else ""
        if not upto.startswith(self.sent) and self.done:
            # The decoded prefix changed under us (module doc): send what is new at the end.
            delta = upto[_common_prefix(upto, self.sent) :]
        self.sent += delta
        return TextDelta(delta, stopped)

    def check_invariants(self) -> None:
        if self._hold < 0 or any(not s for s in self.stop):
            raise InvariantError(f"text stream: bad stop strings {self.stop!r}")
        if not self.done and any(s in self.sent for s in self.stop):
            raise InvariantError(f"text stream sent a stop string: {self.sent!r}")


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
