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

    TAG | chain hash at a | tokens[a:c] (8 bytes each) | tokens[c] (groups keyed ahead)

    B = 8, c = 21: a = 16; full blocks [0,8) [8,16) cached as usual; the partial block
    holds 16..20, keyed by (hash at 16, tokens 16..20); the state after 21 likewise.
    next prompt: tokens[:21] + message -> hit 21 (was 16)

The key holds the tokens themselves, so a hit is an exact token match of the prefix
(the chain hash at ``a`` names everything before it). A lookup at anchor ``a`` tries
each entry kept there (few: one per turn that ended in that block) and keeps the longest
whose tokens prefix the new request's.

Sharing: a partial attention block's slots past ``c`` are not the new request's, so a
hit *takes the block over* (`BlockPool.uncache` after the touch: it leaves the index and
becomes the request's private block, written from ``c`` on). Entries of token-indexed
groups are therefore always free blocks (ref count 0), which `PartialIndex.check`
verifies; a second request that looked the same entry up sees the takeover in
`Coordinator.num_evictions` and looks up again. A state entry is read only (like any
checkpoint) and stays cached. Entries are made only when their request lets go of the
block; a block still in use (or cached for full-block hits) is served by a *copy* of
its first slots instead (`cache.junction`, with the junction rule).

Limits: an end inside the first block (``a == 0``) is not kept (the chain's root is
not a hash the managers see); the end of a *prompt* while its request decodes on is not
kept (that would need a copy of the block being written).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from hybridkv.cache.junction import token_bytes
from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId

if TYPE_CHECKING:
    from hybridkv.cache.block_pool import BlockPool
    from hybridkv.cache.coordinator import Coordinator
    from hybridkv.cache.managers.base import GroupManager

TURN_END = "turn_end"
_TAG = b"hybridkv-turn-end|"
# the shortest turn-end key: tag, a chain hash (sha256: 32 bytes) and one token. Block
# keys are shorter (a digest, + 8 bytes when keyed ahead), so an evicted block whose key
# is shorter needs no lookup here (every eviction asks, `PartialIndex.discard`)
_MIN_KEY_BYTES: Final = len(_TAG) + 32 + 8


class PartialIndex:
    """The turn-end entries of one pool, by group and anchor (the chain hash at ``a``).
    The keys themselves live in the pool's group index like any block hash (so eviction
    and the index checks treat them alike); this table only lets a lookup enumerate the
    entries anchored at one block boundary. An entry's end is its anchor's position
    plus the tokens its key holds (`find_turn_end`). Most anchors hold one entry: ``only``
    maps them to its key, and only anchors with more hold a list (``many``, oldest
    first): no container per entry, which would live as long as the entry and keep the
    garbage collector busy (a hybrid trace keeps thousands)."""

    def __init__(self) -> None:
        self.only: dict[int, dict[bytes, bytes]] = {}  # group -> anchor -> its one key
        self.many: dict[int, dict[bytes, list[bytes]]] = {}  # group -> anchor -> keys (2+)
        self.anchor_of: dict[int, dict[bytes, bytes]] = {}  # group -> key -> anchor
        self.num_entries = 0

    def __len__(self) -> int:
        return self.num_entries

    def add(self, group_id: int, anchor: bytes, key: bytes) -> None:
        only = self.only.get(group_id)
        if only is None:
            only = self.only[group_id] = {}
            self.many[group_id] = {}
            self.anchor_of[group_id] = {}
        keys = self.anchor_of[group_id]
        if key in keys:
            return
        keys[key] = anchor
        self.num_entries += 1
        listed = self.many[group_id].get(anchor)
        if listed is not None:
            listed.append(key)
            return
        other = only.get(anchor)
        if other is None:
            only[anchor] = key
        else:
            del only[anchor]
            self.many[group_id][anchor] = [other, key]

    def discard(self, group_id: int, key: bytes) -> None:
        """Forget ``key`` if it is a turn-end entry (called for every evicted block)."""
        if len(key) < _MIN_KEY_BYTES:
            return  # a block key (no lookup: most evictions)
        keys = self.anchor_of.get(group_id)
        anchor = None if keys is None else keys.get(key)
        if keys is None or anchor is None:
            return
        del keys[key]
        self.num_entries -= 1
        only = self.only[group_id]
        if only.get(anchor) == key:
            del only[anchor]
            return
        many = self.many[group_id]
        listed = many[anchor]
        listed.remove(key)
        if len(listed) == 1:  # back to one entry
            del many[anchor]
            only[anchor] = listed[0]

    def entries(self, group_id: int, anchor: bytes) -> list[bytes] | None:
        """The keys of the entries anchored at ``anchor``, oldest first (None: none)."""
        only = self.only.get(group_id)
        if only is None:
            return None
        key = only.get(anchor)
        return [key] if key is not None else self.many[group_id].get(anchor)

    def anchor(self, group_id: int, key: bytes) -> bytes | None:
        """The anchor of turn-end entry ``key`` of ``group_id`` (None: not an entry)."""
        keys = self.anchor_of.get(group_id)
        return None if keys is None else keys.get(key)

    def check(self, pool: BlockPool, token_groups: set[int]) -> None:
        """Every entry is indexed by the pool under its key, listed once under its
        anchor, ends past its anchor; entries of token-indexed groups are free blocks."""
        count = 0
        for group, only in self.only.items():
            listed = [(anchor, [key]) for anchor, key in only.items()]
            for anchor, keys in self.many[group].items():
                if len(keys) < 2 or anchor in only:
                    raise InvariantError(
                        f"pool {pool.pool_id} group {group}: {len(keys)} turn-end entries "
                        "listed under one anchor (2+), or the anchor is also single"
                    )
                listed.append((anchor, keys))
            for anchor, keys in listed:
                for key in keys:
                    count += 1
                    self._check_entry(pool, token_groups, group, anchor, key)
        by_key = sum(len(keys) for keys in self.anchor_of.values())
        if not count == by_key == self.num_entries:
            raise InvariantError(
                f"pool {pool.pool_id}: {count} turn-end entries by anchor, {by_key} by key, "
                f"{self.num_entries} counted"
            )

    def _check_entry(
        self, pool: BlockPool, token_groups: set[int], group: int, anchor: bytes, key: bytes
    ) -> None:
        block = pool.index[group].get(key)
        if block is None:
            raise InvariantError(
                f"pool {pool.pool_id} group {group}: a turn-end entry is not indexed"
            )
        end = pool.hash_end[block]
        if (
            self.anchor(group, key) != anchor
            or not key.startswith(_TAG + anchor)
            or len(key) < _MIN_KEY_BYTES
        ):
            raise InvariantError(
                f"pool {pool.pool_id} group {group}: turn-end entry ending at {end} "
                "has a stale anchor"
            )
        if group in token_groups and pool.ref_counts[block] != 0:
            raise InvariantError(
                f"pool {pool.pool_id} group {group}: partial block {block} (turn end "
                f"{end}) is cached with {pool.ref_counts[block]} references; a hit "
                "must take it over"
            )


def _key(
    manager: GroupManager, anchor: bytes, tokens: Sequence[int], start: int, end: int
) -> bytes:
    ahead = 1 if manager.key_ahead else 0
    spans = manager.pool.spans  # one build per call of the coordinator (`span_bytes`)
    if spans is not None:
        key = spans.get((start, end, ahead))
        if key is not None:
            return key
    key = _TAG + anchor + token_bytes(tokens, start, end)
    if ahead:
        key += int(tokens[end]).to_bytes(8, "little", signed=True)
    if spans is not None:
        spans[(start, end, ahead)] = key
    return key


def _anchor_hash(manager: GroupManager, hashes: Sequence[bytes], anchor: int) -> bytes | None:
    """Chain hash at the block boundary ``anchor`` (None: not hashed, or ``anchor == 0``)."""
    unit = manager.unit_tokens
    if anchor <= 0 or anchor // unit > len(hashes):
        return None
    return hashes[anchor // unit - 1]


def find_turn_end(
    manager: GroupManager,
    hashes: Sequence[bytes],
    tokens: Sequence[int],
    anchor: int,
    limit: int,
    exact: bool = False,
) -> tuple[int, BlockId] | None:
    """Longest turn-end entry of ``manager``'s group anchored at boundary ``anchor``
    whose tokens prefix ``tokens[anchor:]`` and that ends at or below ``limit``
    (``exact``: ends exactly at ``limit``); (end, block) or None."""
    partial = manager.pool.partial
    unit = manager.unit_tokens
    if partial is None or anchor <= 0 or anchor // unit > len(hashes):
        return None  # `_anchor_hash` is None: inline, as `entries` below (a lookup's
    anchor_hash = hashes[anchor // unit - 1]  # every token group asks at every pass)
    keys = partial.entries(manager.group_id, anchor_hash)
    if not keys:
        return None
    # an entry's end: its anchor plus the tokens its key holds (8 bytes each, see `_key`)
    fixed = len(_TAG) + len(anchor_hash) + (8 if manager.key_ahead else 0)
    best: tuple[int, BlockId] | None = None
    for key in keys:
        end = anchor + (len(key) - fixed) // 8
        if end > limit or (exact and end != limit) or (best is not None and end <= best[0]):
            continue
        if end >= len(tokens):  # a hit leaves >= 1 token (and keyed ahead reads it)
            continue
        if key == _key(manager, anchor_hash, tokens, anchor, end):
            best = (end, manager.index[key])
    return best


def store_turn_end(
    manager: GroupManager,
    block: BlockId,
    hashes: Sequence[bytes],
    tokens: Sequence[int],
    end: int,
) -> bool:
    """Cache ``block`` (referenced, uncached, holding positions up to ``end``) as the
    turn-end entry at ``end``; False (nothing changed) when ``end`` is a block boundary,
    inside the first block, not followed by a verified token in a group keyed ahead, or
    already kept by another block."""
    partial = manager.pool.partial
    size = manager.block_size
    if partial is None or end % size == 0 or end >= len(tokens) + (0 if manager.key_ahead else 1):
        return False
    anchor = end // size * size
    anchor_hash = _anchor_hash(manager, hashes, anchor)
    if anchor_hash is None:
        return False
    key = _key(manager, anchor_hash, tokens, anchor, end)
    if not manager.pool.cache(block, manager.group_id, key, end):
        return False
    partial.add(manager.group_id, anchor_hash, key)
    return True


def enable_turn_end(coordinator: Coordinator) -> None:
    """Switch the turn_end rule on for every pool and group of ``coordinator``."""
    coordinator.turn_end = True
    for pool in coordinator.pools:
        pool.partial = PartialIndex()
    for manager in coordinator.managers:
        manager.turn_end = True
        if not manager.is_state:
            manager.pool.partial_groups.add(manager.group_id)
