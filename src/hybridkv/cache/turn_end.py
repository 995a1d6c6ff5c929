"""Turn-end checkpoints (checkpoint rule ``turn_end``): a request that releases its
blocks keeps the end of what it computed, so the next turn resumes at its last token.

A multi-turn session's next prompt extends the previous prompt + output, which ends
mid-block; block-granular caching stops the hit at the last full block (or state
checkpoint), up to ``B - 1`` tokens (hundreds with hybrid page sizes) short. With this
rule, when a request is freed (or preempted) after ``c`` computed tokens, ``c`` not a
multiple of a group's block size ``B``:

* token-indexed groups cache their *partial* last block (positions ``[a, c)``,
  ``a = c // B * B``) instead of freeing it;
* state groups cache their running state (the state after exactly ``c`` tokens).

Both are released at once into the eviction policy's first tier (``chain``: with the
dead blocks; ``lru`` has one tier): an entry serves one continuation only (the
session's next turn), and single-turn traffic leaves one per request that nobody
comes back for. With memory to spare they stay; under pressure they go before any
block that can serve a shared prefix, so the rule never costs the block hits.

Key of such an entry (never equal to a chain hash: it is longer than a digest)::

    TAG | anchor | tokens[a:c] (8 bytes each) | tokens[c] (groups keyed ahead)

The anchor is the chain hash at ``a`` (`hashing.chain_hash_at`), which names everything
before it; at ``a == 0`` it is the chain's root, the digest of the extra keys that key
the first block (cache salt, LoRA id), so an entry never serves another tenant::

    B = 8, c = 21: a = 16; full blocks [0,8) [8,16) cached as usual; the partial block
    holds 16..20, keyed by (hash at 16, tokens 16..20); the state after 21 likewise.
    next prompt: tokens[:21] + message -> hit 21 (was 16)

    B = 256, c = 240 (a first turn inside the first block): a = 0, keyed by (root,
    tokens 0..239). next prompt: tokens[:241] + message -> hit 240 (was 0)

The key holds the tokens themselves, so a hit is an exact token match of the prefix.
A lookup at anchor ``a`` wants the longest entry kept there whose tokens prefix the new
request's. Entries under one anchor are kept sorted by key (`PartialIndex`), and the
longest that prefixes the prompt is found by bisection (`_longest_prefix`), not by a
scan: the root anchors every short request of a tenant, and a shared system prompt
anchors every session's turn ending in the block after it.

Sharing: a partial attention block's slots past ``c`` are not the new request's, so a
hit *takes the block over* (`BlockPool.uncache` after the touch: it leaves the index and
becomes the request's private block, written from ``c`` on). Entries of token-indexed
groups are therefore always free blocks (ref count 0), which `PartialIndex.check`
verifies; a second request that looked the same entry up sees the takeover in
`Coordinator.num_evictions` and looks up again. A state entry is read only (like any
checkpoint) and stays cached. Entries are made only when their request lets go of the
block; a block still in use (or cached for full-block hits) is served by a *copy* of
its first slots instead (`cache.junction`, with the junction rule).

Limits: the end of a *prompt* while its request decodes on is not kept (that would need
a copy of the block being written); an entry serves only a prompt that extends its
tokens exactly (a prompt diverging inside the partial block misses it).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from hybridkv.cache.hashing import chain_hash_at
from hybridkv.cache.indexes import MIN_TURN_END_KEY_BYTES, TURN_END_TAG
from hybridkv.cache.indexes import PartialIndex as PartialIndex
from hybridkv.cache.junction import _common_prefix, token_bytes
from hybridkv.ids import BlockId

if TYPE_CHECKING:
    from hybridkv.cache.managers.base import GroupManager

TURN_END = "turn_end"
# the index and its key sizes live with the pool (`cache.indexes`); still importable here
_TAG: Final = TURN_END_TAG
_MIN_KEY_BYTES: Final = MIN_TURN_END_KEY_BYTES


def _key(
    manager: GroupManager, anchor: bytes, tokens: Sequence[int], start: int, end: int
) -> bytes:
    """The key of an entry anchored at ``start`` ending at ``end`` (see the module
    docstring): the token after it too in a group keyed ahead, in the same bytes as the
    others, so that the keys of shorter entries prefix it (`_longest_prefix`)."""
    ahead = 1 if manager.key_ahead else 0
    spans = manager.pool.spans  # one build per call of the coordinator (`span_bytes`)
    if spans is not None:
        key = spans.get((start, end, ahead))
        if key is not None:
            return key
    key = _TAG + anchor + token_bytes(tokens, start, end + ahead)
    if spans is not None:
        spans[(start, end, ahead)] = key
    return key


def _longest_prefix(keys: list[bytes], want: bytes, head: int) -> bytes | None:
    """The longest of ``keys`` (sorted; each ``head`` bytes, then whole tokens of 8
    bytes) that prefixes ``want``, or None.

    The greatest key ``<= want`` either prefixes it (then no longer key does: it would
    sort between the two) or first differs from it at byte ``d`` with a smaller byte; a
    key prefixing ``want`` and longer than ``d`` would sort after it, so the answer
    prefixes ``want[:d]`` cut to whole tokens: bisect again with that. Each round
    shortens ``want``; a round costs a bisection (C compares), not a pass over keys::

        keys (tokens)  [1 2] [1 2 3 4] [1 2 5] [7]      want [1 2 3 9]
        greatest <= want: [1 2 3 4], differs at token 3 -> want [1 2 3]
        greatest <= want: [1 2], a prefix -> the answer
    """
    if len(keys) == 1:  # most anchors
        key = keys[0]
        return key if want.startswith(key) else None
    while True:
        i = bisect_right(keys, want)
        if i == 0:
            return None
        key = keys[i - 1]
        if want.startswith(key):
            return key
        cut = head + 8 * _common_prefix(key[head:], want[head:])
        if cut <= head:
            return None  # no token in common: every key holds at least one
        want = want[:cut]


def find_turn_end(
    manager: GroupManager,
    hashes: Sequence[bytes],
    root: bytes,
    tokens: Sequence[int],
    anchor: int,
    limit: int,
    exact: bool = False,
) -> tuple[int, BlockId] | None:
    """Longest turn-end entry of ``manager``'s group anchored at boundary ``anchor``
    whose tokens prefix ``tokens[anchor:]`` and that ends at or below ``limit``
    (``exact``: ends exactly at ``limit``); (end, block) or None. ``root``: the chain's
    root (`hashing.chain_hash_at`), the anchor at 0."""
    partial = manager.pool.partial
    if partial is None:
        return None
    # `chain_hash_at` inline (every token group asks at every pass of a lookup)
    if anchor == 0:
        anchor_hash = root
    elif anchor < 0 or anchor // manager.unit_tokens > len(hashes):
        return None
    else:
        anchor_hash = hashes[anchor // manager.unit_tokens - 1]
    # a hit leaves >= 1 token (and keyed ahead reads it); entries end inside the block
    top = min(limit, len(tokens) - 1, anchor + manager.block_size - 1)
    if exact:  # the one key an entry ending at ``limit`` has
        if not anchor < limit <= top:
            return None
        block = manager.index.get(_key(manager, anchor_hash, tokens, anchor, limit))
        return None if block is None else (limit, block)
    keys = partial.entries(manager.group_id, anchor_hash)
    if not keys or top <= anchor:
        return None
    head = len(_TAG) + len(anchor_hash)
    key = _longest_prefix(keys, _key(manager, anchor_hash, tokens, anchor, top), head)
    if key is None:
        return None
    # an entry's end: its anchor plus the tokens its key holds (8 bytes each, see `_key`)
    end = anchor + (len(key) - head) // 8 - (1 if manager.key_ahead else 0)
    return end, manager.index[key]


def store_turn_end(
    manager: GroupManager,
    block: BlockId,
    hashes: Sequence[bytes],
    root: bytes,
    tokens: Sequence[int],
    end: int,
) -> bool:
    """Cache ``block`` (referenced, uncached, holding positions up to ``end``) as the
    turn-end entry at ``end``; False (nothing changed) when ``end`` is a block boundary,
    not followed by a verified token in a group keyed ahead, not hashed up to its
    anchor, or already kept by another block. ``root``: as in `find_turn_end`."""
    partial = manager.pool.partial
    size = manager.block_size
    if partial is None or end % size == 0 or end >= len(tokens) + (0 if manager.key_ahead else 1):
        return False
    anchor = end // size * size
    anchor_hash = chain_hash_at(hashes, root, manager.unit_tokens, anchor)
    if anchor_hash is None:
        return False
    key = _key(manager, anchor_hash, tokens, anchor, end)
    if not manager.pool.cache(block, manager.group_id, key, end):
        return False
    partial.add(manager.group_id, anchor_hash, key)
    return True
