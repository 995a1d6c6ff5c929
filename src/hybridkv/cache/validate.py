"""Validation of what callers hand the `CacheManager`: counts, token ids and batch
lengths, each refused with a `CacheError` naming the request and the bad value before
anything changes (check, then commit)."""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Sequence
from itertools import chain
from typing import Final, cast

from hybridkv.cache.hashing import MAX_TOKEN_ID
from hybridkv.errors import CacheError

# byte holding the sign bit of a 64-bit int in the machine's byte order
_HIGH_BYTE = 7 if sys.byteorder == "little" else 0
# The largest count a fast path takes unchecked (2^62 - 1: docs/compiled_core.md);
# valid larger counts go through the checked path
FAST_MAX_COUNT: Final = (1 << 62) - 1


def check_count(req_id: str, name: str, value: object) -> int:
    """``value`` as an int in [0, 2^63) (numpy integers welcome), or a CacheError."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise CacheError(
            f"request {req_id!r}: {name} must be a non-negative int, got "
            f"{type(value).__name__} {value!r}"
        )
    number = operator.index(value)  # type: ignore[call-overload]
    if not 0 <= number <= MAX_TOKEN_ID:
        raise CacheError(f"request {req_id!r}: {name}={number} must be in [0, 2^63)")
    return number


def token_array(req_id: str, name: str, tokens: object) -> array[int]:
    """``tokens`` packed as 64-bit ints (the request's own storage; hashing reads its
    bytes directly), or a CacheError naming the first bad one. Any integer type converts
    (numpy integers, and bools as 0 / 1); floats, negative ids and ids >= 2^63 are
    refused. The array is unsigned ('Q'): ids below 2^63 have the bytes of signed ints,
    and appending to it converts each id without the signed type's argument parsing
    (`append_tokens`)."""
    if isinstance(tokens, str | bytes) or not hasattr(tokens, "__iter__"):
        raise CacheError(
            f"request {req_id!r}: {name} must be a sequence of token ids, got "
            f"{type(tokens).__name__}"
        )
    if not isinstance(tokens, list | tuple | array):
        tokens = list(tokens)  # type: ignore[call-overload]  # iterate once
    # Unsigned conversion at C speed refuses negative ids and non-integers; the top bit
    # of each id's most significant byte then tells ids >= 2^63 apart, in one C pass over
    # the bytes (min() over the array would box every id: 4x the cost).
    try:
        raw = array("Q", tokens)  # type: ignore[arg-type]
    except (TypeError, OverflowError):
        raw = None
    if raw is not None and raw.tobytes()[_HIGH_BYTE::8].isascii():
        return raw
    for i, t in enumerate(tokens):  # type: ignore[arg-type]  # name the culprit
        if not hasattr(t, "__index__"):
            raise CacheError(
                f"request {req_id!r}: {name}[{i}] is {type(t).__name__} {t!r}; token ids are ints"
            )
        value = operator.index(t)
        if not 0 <= value <= MAX_TOKEN_ID:
            raise CacheError(
                f"request {req_id!r}: {name}[{i}] = {value} is outside [0, 2^63); token ids "
                "are non-negative 64-bit ints"
            )
    raise AssertionError("unreachable: array() refused a valid token list")


def append_tokens(tokens: array[int], new: Sequence[int]) -> bool:
    """Append ``new`` to ``tokens`` (a `token_array`) if every id is an int in [0, 2^63)
    and return True; else leave ``tokens`` as it was and return False (`token_array`
    names the culprit). The unsigned array refuses non-integers and negative ids at C
    speed; ids >= 2^63 are looked for after (the unsigned array takes them)."""
    num = len(tokens)
    if isinstance(new, list):
        # a scheduler's list (the common case): `fromlist` is all-or-nothing and sets
        # the ids in place, about half of `extend`'s cost on a decode step's few ids
        try:
            tokens.fromlist(new)
        except (TypeError, OverflowError):
            return False
        if _all_signed(new):
            return True
        del tokens[num:]
        return False
    if not isinstance(new, tuple):  # arrays, generators, str / bytes: `token_array` decides
        return False
    if not new:
        return True
    try:
        tokens.extend(new)
    except (TypeError, OverflowError):
        del tokens[num:]  # extend may have appended the ids before the bad one
        return False
    if max(new) > MAX_TOKEN_ID:
        del tokens[num:]
        return False
    return True


def _all_signed(ids: list[int]) -> bool:
    """No id above 2^63 - 1 (``ids`` passed the unsigned array: integers >= 0), or
    False when unsure (then the checked path judges them)."""
    try:
        for t in ids:
            if t > FAST_MAX_COUNT and t > MAX_TOKEN_ID:
                return False
    except TypeError:
        return False
    return True


_LIST_TYPES = frozenset((list, tuple))
_INT_TYPES = frozenset((int,))


def all_counts(values: Sequence[object], upper: int = MAX_TOKEN_ID) -> bool:
    """True if every value is a plain int in [0, ``upper``] (C speed; bools, numpy
    integers, floats and larger values say False, and the checked path then judges
    each)."""
    if not _INT_TYPES.issuperset(map(type, values)):
        return False
    ints = cast("Sequence[int]", values)  # every one a plain int (checked above)
    return min(ints, default=0) >= 0 and max(ints, default=0) <= upper


def all_valid_token_lists(lists: Sequence[Sequence[int]]) -> bool:
    """True if every item of ``lists`` is a list or tuple of ints in [0, 2^63): one
    C-speed pass over all ids of a batch (a commit's new tokens), so that each request
    can extend its tokens without its own check. False says nothing about which one is
    bad (`append_tokens` / `token_array` then check each)."""
    if not _LIST_TYPES.issuperset(map(type, lists)):
        return False  # arrays, generators, str: iterated once, by their own request only
    try:
        # unsigned: negative ids and non-integers raise; the top bit of each id's most
        # significant byte tells ids >= 2^63 apart (as in `token_array`)
        raw = array("Q", chain.from_iterable(lists))
    except (TypeError, OverflowError):
        return False
    return raw.tobytes()[_HIGH_BYTE::8].isascii()


def check_same_lengths(call: str, req_ids: Sequence[str], **others: Sequence[object]) -> None:
    for name, values in others.items():
        if len(values) != len(req_ids):
            raise CacheError(
                f"{call}: {len(req_ids)} req_ids but {len(values)} {name}; pass one per "
                "request (nothing was allocated or committed)"
            )
