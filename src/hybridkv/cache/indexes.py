"""The indexes a pool keeps beside its per-group hash indexes, for the two extra
checkpoint rules: `PartialIndex` (turn-end entries by anchor, `cache.turn_end`) and
`ChildIndex` (cached full blocks by parent hash, `cache.junction`). Plain data owned by
`BlockPool`, which keeps them consistent with eviction; the rules that fill and read
them act on one group (`cache.turn_end`, `cache.junction`); a pool keeps them when its
`CacheRules` say so.
"""

from __future__ import annotations

from bisect import insort
from typing import Final, Protocol

from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId

TURN_END_TAG = b"hybridkv-turn-end|"
# the shortest turn-end key: tag, a chain hash (sha256: 32 bytes) and one token. Block
# keys are shorter (a digest, + 8 bytes when keyed ahead), so an evicted block whose key
# is shorter needs no lookup here (every eviction asks, `PartialIndex.discard`)
MIN_TURN_END_KEY_BYTES: Final = len(TURN_END_TAG) + 32 + 8
# Children kept per (group, parent): a parent with more (many prompts diverging at the
# same block) keeps the newest; the oldest are likely evicted already.
MAX_CHILDREN_PER_PARENT: Final = 8


class PoolFacts(Protocol):
    """What the index checks read of their pool (`BlockPool`)."""

    pool_id: int
    index: dict[int, dict[bytes, BlockId]]
    hash_group: list[int]
    hash_end: list[int]
    ref_counts: list[int]


class PartialIndex:
    """The turn-end entries of one pool, by group and anchor (the chain hash at ``a``,
    the root at 0). The keys themselves live in the pool's group index like any block
    hash (so eviction and the index checks treat them alike); this table only lets a
    lookup find the entries anchored at one block boundary. An entry's end is its
    anchor's position plus the tokens its key holds (`find_turn_end`). Most anchors hold
    one entry: ``only`` maps them to its key, and only anchors with more hold a list
    (``many``, sorted by key, so by tokens: a lookup bisects it): no container per
    entry, which would live as long as the entry and keep the garbage collector busy (a
    hybrid trace keeps thousands)."""

    def __init__(self) -> None:
        self.only: dict[int, dict[bytes, bytes]] = {}  # group -> anchor -> its one key
        self.many: dict[int, dict[bytes, list[bytes]]] = {}  # group -> anchor -> sorted keys
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
            insort(listed, key)
            return
        other = only.get(anchor)
        if other is None:
            only[anchor] = key
        else:
            del only[anchor]
            self.many[group_id][anchor] = [other, key] if other < key else [key, other]

    def discard(self, group_id: int, key: bytes) -> None:
        """Forget ``key`` if it is a turn-end entry (called for every evicted block)."""
        if len(key) < MIN_TURN_END_KEY_BYTES:
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
        """The keys of the entries anchored at ``anchor``, sorted (None: none)."""
        only = self.only.get(group_id)
        if only is None:
            return None
        key = only.get(anchor)
        return [key] if key is not None else self.many[group_id].get(anchor)

    def anchor(self, group_id: int, key: bytes) -> bytes | None:
        """The anchor of turn-end entry ``key`` of ``group_id`` (None: not an entry)."""
        keys = self.anchor_of.get(group_id)
        return None if keys is None else keys.get(key)

    def check(self, pool: PoolFacts, token_groups: frozenset[int]) -> None:
        """Every entry is indexed by the pool under its key, listed once under its
        anchor (lists sorted), ends past its anchor; entries of token-indexed groups are
        free blocks."""
        count = 0
        for group, only in self.only.items():
            listed = [(anchor, [key]) for anchor, key in only.items()]
            for anchor, keys in self.many[group].items():
                if len(keys) < 2 or anchor in only or keys != sorted(keys):
                    raise InvariantError(
                        f"pool {pool.pool_id} group {group}: {len(keys)} turn-end entries "
                        "listed under one anchor (2+, sorted), or the anchor is also single"
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
        self, pool: PoolFacts, token_groups: frozenset[int], group: int, anchor: bytes, key: bytes
    ) -> None:
        block = pool.index[group].get(key)
        if block is None:
            raise InvariantError(
                f"pool {pool.pool_id} group {group}: a turn-end entry is not indexed"
            )
        end = pool.hash_end[block]
        if (
            self.anchor(group, key) != anchor
            or not key.startswith(TURN_END_TAG + anchor)
            or len(key) < MIN_TURN_END_KEY_BYTES
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


class ChildIndex:
    """Cached full blocks of one pool by parent (the chain hash before the block), per
    group, at most `MAX_CHILDREN_PER_PARENT` per parent, oldest first; a block's tokens
    (bytes, 8 per token) in ``payload_of[block]`` and its parent hash in
    ``parent_of[block]`` (None: not indexed; its group is the pool's ``hash_group``).

    Most parents have one child: ``only`` maps them to it, and only parents with more
    hold a list (``many``). No container per cached block (a dict or a ``(group,
    parent)`` key per block would live as long as the block and keep the garbage
    collector busy), and per-block facts in lists by block id, read at every cache and
    eviction."""

    def __init__(self, num_blocks: int) -> None:
        self.only: dict[int, dict[bytes, BlockId]] = {}  # group -> parent -> its child
        self.many: dict[int, dict[bytes, list[BlockId]]] = {}  # group -> parent -> 2..8
        self.parent_of: list[bytes | None] = [None] * num_blocks
        self.payload_of: list[bytes] = [b""] * num_blocks
        self.num_children = 0
        # `find_partial`'s memo: the common prefix (tokens) of the last prompt span
        # compared (``memo_want``) with each payload compared to it. A pure function of
        # two values, so it never goes stale; it serves every group of the pool, whose
        # children under one parent hold the same tokens (one comparison, not one per
        # group and pass of the lookup's fixed point)
        self.memo_want = b""
        self.memo: dict[bytes, int] = {}

    def __len__(self) -> int:
        return self.num_children

    def maps(self, group_id: int) -> tuple[dict[bytes, BlockId], dict[bytes, list[BlockId]]]:
        """``group_id``'s (only, many) maps (made on first use)."""
        only = self.only.get(group_id)
        if only is None:
            only = self.only[group_id] = {}
            self.many[group_id] = {}
        return only, self.many[group_id]

    def children_of(self, group_id: int, parent: bytes) -> list[BlockId]:
        """The children of ``parent`` in ``group_id``, oldest first (read only)."""
        only = self.only.get(group_id)
        if only is None:
            return []
        block = only.get(parent)
        if block is not None:
            return [block]
        return self.many[group_id].get(parent, [])

    def by_parent(self) -> list[tuple[int, bytes, list[BlockId]]]:
        """Every (group, parent, children oldest first) of the index."""
        out = [
            (g, parent, [block]) for g, only in self.only.items() for parent, block in only.items()
        ]
        out += [(g, parent, kids) for g, many in self.many.items() for parent, kids in many.items()]
        return out

    def add(self, group_id: int, parent: bytes, block: BlockId, payload: bytes) -> None:
        only, many = self.maps(group_id)
        self.link(only, many, parent, block, payload)

    def link(
        self,
        only: dict[bytes, BlockId],
        many: dict[bytes, list[BlockId]],
        parent: bytes,
        block: BlockId,
        payload: bytes,
    ) -> None:
        """`add` with the group's maps at hand (`note_children` indexes a chunk's
        blocks with one `maps` call)."""
        self.parent_of[block] = parent
        self.payload_of[block] = payload
        self.num_children += 1
        kids = many.get(parent)
        if kids is not None:
            kids.append(block)
            if len(kids) > MAX_CHILDREN_PER_PARENT:
                self._forget(kids.pop(0))  # the oldest goes
            return
        other = only.get(parent)
        if other is None:
            only[parent] = block
        else:
            del only[parent]
            many[parent] = [other, block]

    def _forget(self, block: BlockId) -> None:
        self.parent_of[block] = None
        self.payload_of[block] = b""
        self.num_children -= 1

    def discard(self, group_id: int, block: BlockId) -> None:
        """Forget ``block`` of ``group_id`` if indexed (called whenever a block leaves
        its hash index)."""
        parent = self.parent_of[block]
        if parent is None:
            return
        self._forget(block)
        only = self.only[group_id]
        child = only.get(parent)
        if child is not None and child == block:
            del only[parent]
            return
        many = self.many[group_id]
        kids = many[parent]
        kids.remove(block)
        if len(kids) == 1:  # back to one child
            del many[parent]
            only[parent] = kids[0]

    def check(self, pool: PoolFacts) -> None:
        """Every child is a cached block of its group, indexed once under its parent
        with its payload, and the counts agree."""
        count = 0
        for group, parent, children in self.by_parent():
            many = len(children) > 1 or parent in self.many.get(group, {})
            if many and not 2 <= len(children) <= MAX_CHILDREN_PER_PARENT:
                raise InvariantError(
                    f"pool {pool.pool_id} group {group}: {len(children)} junction children "
                    f"listed under one parent (2..{MAX_CHILDREN_PER_PARENT})"
                )
            if many and parent in self.only.get(group, {}):
                raise InvariantError(
                    f"pool {pool.pool_id} group {group}: a junction parent is both single "
                    "and listed"
                )
            for block in children:
                count += 1
                if (
                    pool.hash_group[block] != group
                    or self.parent_of[block] != parent
                    or not self.payload_of[block]
                ):
                    raise InvariantError(
                        f"pool {pool.pool_id} group {group}: junction child block {block} "
                        f"is not cached in this group (hash group {pool.hash_group[block]}) "
                        "or has no parent or payload"
                    )
        by_block = sum(parent is not None for parent in self.parent_of)
        if not count == by_block == self.num_children:
            raise InvariantError(
                f"pool {pool.pool_id}: {count} junction children by parent, {by_block} by "
                f"block, {self.num_children} counted"
            )
