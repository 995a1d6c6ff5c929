"""Structures reshaped so that the cache core hands the garbage collector fewer objects
(issue 25, thirteenth session): ghost keys as bytes, the turn-end discard's length gate,
junction parents by block id, the request record's fast limits (a flat list of ints
then; one `GroupLimits` of native ints per group since), token lists
appended with `array.fromlist`. Each keeps the behaviour of the form it replaced."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache import CacheManager
from hybridkv.cache.block_pool import BlockPool
from hybridkv.cache.rules import CacheRules
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.cache.turn_end import _MIN_KEY_BYTES, PartialIndex
from hybridkv.errors import CacheError, InvariantError
from hybridkv.plan.types import PoolPlan


def _two_group_pool(num_pages: int = 3) -> BlockPool:
    plan_ = PoolPlan(pool_id=0, page_bytes=1, num_pages=num_pages, num_tensors=1, group_ids=(0, 1))
    return BlockPool(plan_, None, CacheRules(eviction_policy="chain"))


def test_ghosts_of_one_hash_in_two_groups_are_two_entries() -> None:
    pool = _two_group_pool()
    key = b"k" * 32
    for group in (0, 1):  # the same hash cached and evicted in each group in turn
        (block,) = pool.take_many(1)
        pool.cache(block, group, key, 16)
        pool.release_many([block])
        pool.take_many(2)  # no fresh block left: the cached one is evicted
        pool.release_many([b for b in range(1, 3) if pool.ref_counts[b]])
    assert pool.ghosts is not None
    assert set(pool.ghosts) == {pool.ghost_key(0, key), pool.ghost_key(1, key)}
    assert pool.ghost_key(0, key) != pool.ghost_key(1, key)
    assert pool.lookup(1, key) is None  # a miss on group 1's ghost takes only that one
    assert set(pool.ghosts) == {pool.ghost_key(0, key)}


def test_ghost_keys_are_unique_across_key_lengths() -> None:
    pool = _two_group_pool()
    # a key of group 0 that ends like group 1's tag is still another ghost: the tag
    # has a fixed size, so equal ghost keys have equal lengths, keys and groups
    short, long = b"a" * 32, b"a" * 32 + (1).to_bytes(4, "little")
    assert pool.ghost_key(0, long)[: len(short) + 4] == pool.ghost_key(1, short)
    assert pool.ghost_key(1, short) != pool.ghost_key(0, long)
    assert pool.ghost_key(1, short) != pool.ghost_key(0, short)


def test_turn_end_discard_skips_block_keys_and_drops_entries() -> None:
    index = PartialIndex()
    anchor = b"h" * 32
    key = b"hybridkv-turn-end|" + anchor + (7).to_bytes(8, "little")
    assert len(key) == _MIN_KEY_BYTES
    index.add(0, anchor, key)
    index.discard(0, anchor)  # a block key (a digest): not an entry, nothing changes
    index.discard(0, anchor + b"t" * 8)  # a block key keyed one token ahead
    assert len(index) == 1 and index.entries(0, anchor) == [key]
    index.discard(1, key)  # another group's entry under the same key: none
    assert len(index) == 1
    index.discard(0, key)
    assert len(index) == 0 and index.entries(0, anchor) is None


def _running(groups: list[ToyGroup]) -> CacheManager:
    cm = CacheManager(toy_plan(groups, num_blocks=32))
    cm.add_request("a", list(range(1, 10)))
    cm.lookup("a")
    cm.allocate("a", 9, 2)
    cm.commit("a", 1, [10, 11])
    return cm


def test_check_invariants_reads_each_groups_cached_limits() -> None:
    cm = _running([ToyGroup("full", 4), ToyGroup("sliding", 4, span_tokens=8)])
    cm.check_invariants()
    record = cm._requests["a"]
    assert len(record.limits) == 2  # one `GroupLimits` per group, made at start
    limits = record.limits[1]
    assert record.group_limits(1) == (
        limits.end,
        limits.verified,
        limits.lookahead,
        limits.commit_below,
    )
    limits.commit_below += 1  # group 1's commit bound goes stale
    with pytest.raises(InvariantError, match="group 1: cached fast limits"):
        cm.check_invariants()


@pytest.mark.parametrize(
    ("new", "message"),
    [
        ([12, 1 << 63], r"new_token_ids\[1\] = 9223372036854775808 is outside"),
        ([12, -1], r"new_token_ids\[1\] = -1 is outside"),
        ([12, "x"], r"new_token_ids\[1\] is str"),
    ],
)
def test_a_refused_token_list_leaves_the_tokens_as_they_were(new: list, message: str) -> None:
    cm = _running([ToyGroup("full", 4)])
    cm.allocate("a", 1, 0)
    with pytest.raises(CacheError, match=message):
        cm.commit("a", 0, new)
    assert cm.token_ids("a") == list(range(1, 12))
    cm.commit("a", 0, [12])
    assert cm.token_ids("a") == list(range(1, 13))
    cm.check_invariants()


def test_a_list_of_numpy_ids_commits_like_plain_ints() -> None:
    cm = _running([ToyGroup("full", 4)])
    cm.allocate("a", 1, 1)
    cm.commit("a", 1, [np.int64(12), np.int32(13)])
    assert cm.token_ids("a") == list(range(1, 14)) and cm.num_computed_tokens("a") == 12
    cm.check_invariants()


def test_turn_end_anchor_with_several_entries_lists_them_oldest_first() -> None:
    """An anchor's one entry sits in ``only`` (no container per entry); a second moves
    both to a list in ``many``; discards go back to ``only`` once one is left."""
    index = PartialIndex()
    anchor = b"h" * 32
    keys = [b"hybridkv-turn-end|" + anchor + bytes([n]) * 8 * n for n in (1, 2, 3)]
    index.add(0, anchor, keys[0])
    assert index.only[0] == {anchor: keys[0]} and not index.many[0]
    index.add(0, anchor, keys[1])
    index.add(0, anchor, keys[2])
    index.add(0, anchor, keys[2])  # again: nothing changes
    assert len(index) == 3 and index.entries(0, anchor) == keys and not index.only[0]
    index.discard(0, keys[1])
    assert index.entries(0, anchor) == [keys[0], keys[2]]
    index.discard(0, keys[0])
    assert index.only[0] == {anchor: keys[2]} and not index.many[0] and len(index) == 1
    assert index.anchor(0, keys[2]) == anchor and index.anchor(0, keys[0]) is None
