"""Prompt-lookup (n-gram) and suffix-matching proposers: drafts copied from the context.

n-gram: take the last ``n`` tokens (``max_n`` down to ``min_n``), find their latest
earlier occurrence, propose the tokens that followed it::

    tokens: a b c d x y a b c  -> last 3 = "a b c", seen at 0..2, followed by "d x y"
    drafts (K=2): d x

suffix: find the longest suffix of the context that occurred before (any length up to
``max_match``), and propose as many tokens as the match earned: a long match is likely
to continue, a short one is not, so the draft count varies 0..K from step to step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _latest_match(tokens: Sequence[int], n: int, want: int = 0) -> int | None:
    """Start index just after the latest earlier occurrence of the last ``n`` tokens that
    is followed by at least ``want`` tokens; failing that, the latest occurrence.

    In a repeating context ``x y x y x y`` the latest occurrence of ``x y`` overlaps the
    end and is followed by two tokens only; one period earlier gives two more."""
    if n <= 0 or len(tokens) <= n:
        return None
    tail = list(tokens[-n:])
    latest = None
    for start in range(len(tokens) - n - 1, -1, -1):
        if list(tokens[start : start + n]) == tail:
            if len(tokens) - (start + n) >= want:
                return start + n
            if latest is None:
                latest = start + n
    return latest


@dataclass
class NgramProposer:
    """Prompt lookup with n from ``max_n`` down to ``min_n``; always proposes up to K."""

    min_n: int = 1
    max_n: int = 4
    name: str = "ngram"

    def propose(self, request_id: str, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        for n in range(self.max_n, self.min_n - 1, -1):
            follow = _latest_match(token_ids, n)
            if follow is not None:
                return list(token_ids[follow : follow + max_num_tokens])
        return []

    def forget(self, request_id: str) -> None:
        return None


@dataclass
class SuffixProposer:
    """Longest earlier suffix match; drafts = min(K, match length - min_match + 1).

    With ``min_match`` 2 a 2-token match proposes 1 draft, a 5-token match 4, and no
    match (or a 1-token one) proposes none: the count jumps between 0 and K.
    """

    min_match: int = 2
    max_match: int = 32
    name: str = "suffix"

    def propose(self, request_id: str, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        best_len, best_follow = 0, None
        for n in range(self.min_match, min(self.max_match, len(token_ids) - 1) + 1):
            want = min(max_num_tokens, n - self.min_match + 1)
            follow = _latest_match(token_ids, n, want)
            if follow is None:
                break  # a longer suffix cannot match if this one does not
            best_len, best_follow = n, follow
        if best_follow is None:
            return []
        count = min(max_num_tokens, best_len - self.min_match + 1)
        return list(token_ids[best_follow : best_follow + count])

    def forget(self, request_id: str) -> None:
        return None
