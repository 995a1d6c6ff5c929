"""Golden cache scenarios with exact block ids; each docstring names the property.

Pools hand out fresh blocks lowest id first (block 0 is the null block), so the ids
below follow from the order of allocations.
"""

from __future__ import annotations

from hybridkv.cache import NULL_BLOCK, CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan

FULL4, STATE8 = ToyGroup("full", 4), ToyGroup("state", 8)


def _prefill(cm: CacheManager, req: str, n: int, sampled: int = 99) -> None:
    assert cm.allocate(req, n) is not None
    cm.commit(req, 0, [sampled])


def test_align_draft_count_falls_from_16_to_1_across_a_block_boundary():
    """Draft counts are not monotonic: 16 drafts then 1 is a no-op for the cache, the
    running state follows the last accepted draft, and a boundary checkpoint is cached
    only when every token it covers is accepted."""
    cm = CacheManager(toy_plan([FULL4, STATE8], num_spec_tokens=16, num_blocks=64))
    cm.add_request("a", list(range(1, 7)))  # 6 prompt tokens
    assert cm.lookup("a") == 0
    _prefill(cm, "a", 6)  # c = 6, tokens = 7
    # decode: token 6 at position 6, 16 drafts at 7..22 (state after 8 = spec[0])
    new = cm.allocate("a", 1, 16).new_block_ids()
    assert new == {0: [4, 5, 6, 7], 1: list(range(8, 24))}  # positions 0..22: 6 blocks
    slots = cm.state_slots("a", 1)
    assert slots.read_block == slots.write_block == 3 and slots.spec_blocks[0] == 8
    cm.commit("a", 2, [7, 8, 9])  # 2 drafts accepted: c = 9, state after 9 in spec[1]
    assert cm.num_computed_tokens("a") == 9
    assert cm.block_info(0, 8).block_hash is not None  # checkpoint after 8 tokens, cached
    assert cm.block_info(0, 8).ref_count == 0  # ... and released to the cache
    assert cm.block_table("a", 1)[0] == 9  # running = spec[1]
    assert cm.stats().num_checkpoints_stored == 1
    # one draft now: nothing to allocate, never an error
    assert cm.allocate("a", 1, 1).new_block_ids() == {}
    assert cm.state_slots("a", 1).spec_blocks == (3,)
    cm.commit("a", 0, [5])  # draft rejected: its state (after 11) is never cached
    assert cm.block_info(0, 3).block_hash is None
    assert cm.stats().num_checkpoints_stored == 1
    cm.check_invariants()


def test_attention_hit_with_state_miss_is_clamped_never_an_empty_state():
    """A prefix hit is the minimum over groups clamped to a stored checkpoint; attention
    hit + state miss never runs with an empty state."""
    cm = CacheManager(toy_plan([FULL4, STATE8], num_blocks=64))
    cm.add_request("a", list(range(1, 15)))  # 14 tokens: checkpoint at 8, blocks 0..2
    cm.lookup("a")
    _prefill(cm, "a", 14)
    cm.add_request("b", [*range(1, 15), 50, 51])
    assert cm.lookup("b") == 8  # attention could serve 12
    assert cm.allocate("b", 8) is not None
    slots = cm.state_slots("b", 1)
    assert slots.read_block is not None and slots.num_computed_tokens == 8
    assert cm.block_table("b", 0)[:2] == cm.block_table("a", 0)[:2]
    # none mode: no checkpoints at all -> no hit, although attention blocks are cached
    cm2 = CacheManager(toy_plan([FULL4, STATE8], num_blocks=64, state_mode="none"))
    cm2.add_request("a", list(range(1, 15)))
    _prefill(cm2, "a", 14)
    cm2.add_request("b", list(range(1, 15)))
    assert cm2.lookup("b") == 0
    assert cm2.allocate("b", 14) is not None
    assert cm2.state_slots("b", 1).read_block is None  # starts from zeros, knowingly
    cm.check_invariants()
    cm2.check_invariants()


def test_eagle_head_group_is_keyed_one_token_ahead_and_drops_no_block():
    """EAGLE / MTP cost no reuse: only a group holding head layers (model "draft") keys
    its blocks by the chain hash plus the next token, so a repeat hits as far as without
    speculation (16, not 12), and a prompt whose token after the hit differs misses
    exactly that head block (12): head KV is never reused for another next token."""
    groups = [FULL4, ToyGroup("sliding", 4, 6), ToyGroup("full", 4, model="draft")]
    cm = CacheManager(toy_plan(groups, num_blocks=64), eagle=True)
    cm.add_request("a", list(range(1, 19)))  # 18 tokens, 4 full blocks, 1 partial
    cm.lookup("a")
    assert cm.allocate("a", 18).new_block_ids() == {
        0: [1, 2, 3, 4, 5],
        1: [6, 7, 8, 9, 10],
        2: [11, 12, 13, 14, 15],
    }
    cm.commit("a", 0, [99])
    # every group cached blocks 0..3 (the head group under keys with tokens 5, 9, 13, 17)
    assert [cm.block_info(0, b).block_hash is not None for b in (4, 9, 14)] == [True] * 3
    assert cm.block_info(0, 14).block_hash != cm.block_info(0, 4).block_hash
    cm.add_request("b", list(range(1, 19)))
    assert cm.lookup("b") == 16
    assert cm.allocate("b", 2).new_block_ids() == {0: [16], 1: [17], 2: [18]}
    assert cm.block_tables("b") == {
        0: [1, 2, 3, 4, 16],
        1: [0, 0, 8, 9, 17],
        2: [11, 12, 13, 14, 18],
    }
    cm.add_request("c", [*range(1, 17), 77, 78])  # token 16 differs from a's (17)
    assert cm.lookup("c") == 12
    cm.check_invariants()
    # without speculation the head group does not exist and nothing is keyed ahead
    plain = CacheManager(toy_plan(groups[:2], num_blocks=64))
    for req in ("a", "c"):
        plain.add_request(req, [*range(1, 17), 77, 78] if req == "c" else list(range(1, 19)))
    plain.lookup("a")
    _prefill(plain, "a", 18)
    assert plain.lookup("c") == 16
    plain.check_invariants()


def test_blocks_with_unaccepted_drafts_are_never_cached():
    """Never cache a block that contains unaccepted draft positions."""
    cm = CacheManager(toy_plan([FULL4], num_spec_tokens=4, num_blocks=16))
    cm.add_request("a", [1, 2, 3])
    cm.lookup("a")
    _prefill(cm, "a", 3, sampled=4)  # c = 3, tokens 1..4
    cm.take_events()
    assert cm.allocate("a", 1, 4).new_block_ids() == {0: [2]}  # positions 3..7: table [1, 2]
    cm.commit("a", 0, [9])  # all drafts rejected: c = 4, block 1 (4..7) holds drafts
    assert [(e.kind, e.block_id, e.num_tokens) for e in cm.take_events()] == [("stored", 1, 4)]
    assert cm.block_info(0, 2).block_hash is None
    assert (
        cm.allocate("a", 1, 3).new_block_ids() == {}
    )  # positions 4..7: the reserved block is reused
    cm.commit("a", 3, [9, 9, 9, 9])  # c = 8: block 1 (4..7) now verified
    assert [(e.kind, e.block_id, e.num_tokens) for e in cm.take_events()] == [("stored", 2, 8)]
    cm.check_invariants()


def test_shrinking_lookahead_is_a_no_op():
    """Needing fewer blocks than held is normal: nothing is allocated or released."""
    cm = CacheManager(
        toy_plan([FULL4, ToyGroup("sliding", 4, 6), STATE8], num_spec_tokens=5, num_blocks=64)
    )
    cm.add_request("a", [1, 2, 3, 4, 5])
    cm.lookup("a")
    _prefill(cm, "a", 5)
    assert cm.allocate("a", 1, 5) is not None
    tables = cm.block_tables("a")
    cm.commit("a", 0, [6])
    for lookahead in (3, 0, 1):
        assert cm.allocate("a", 1, lookahead).new_block_ids() == {}
        assert cm.block_tables("a") == tables
        cm.commit("a", 0, [7])
        tables = cm.block_tables("a")
    cm.check_invariants()


def test_failed_allocate_changes_nothing_and_hits_are_touched_first():
    """Check, then commit: a too-large allocate returns None with nothing changed; a
    successful one takes hit blocks out of the free queue before taking new blocks."""
    # block-granular (no turn-end entry for the partial block 3)
    cm = CacheManager(toy_plan([FULL4], num_blocks=6), checkpoint_rules=())  # 5 usable
    cm.add_request("a", list(range(1, 10)))
    cm.lookup("a")
    _prefill(cm, "a", 9)  # blocks 1, 2 cached, 3 private
    cm.free("a")  # 3 -> fresh, then 2, 1 -> cached LRU (tail evicted first)
    cm.add_request("b", list(range(1, 10)) + [7] * 12)
    assert cm.lookup("b") == 8
    assert cm.allocate("b", 13) is None  # needs 6 blocks, 5 usable
    assert cm.num_free_blocks() == 5 and cm.block_info(0, 1).block_hash is not None
    assert cm.allocate("b", 12).new_block_ids() == {0: [3, 4, 5]}
    assert cm.block_table("b", 0) == [1, 2, 3, 4, 5]
    cm.check_invariants()


def test_sliding_delta_nulls_positions_that_left_the_window():
    """`allocate` hands an engine only what changed: the block taken for the next
    position and the table positions released by the previous commit (out of the
    window), never a whole-table copy after admission."""
    cm = CacheManager(toy_plan([ToyGroup("sliding", 4, 5)], num_blocks=16))
    cm.add_request("a", list(range(1, 9)))  # 8 prompt tokens
    assert cm.lookup("a") == 0
    first = cm.allocate("a", 8)
    assert first.admitted and first.groups[0].start == 0
    row = []
    first.groups[0].apply(row, NULL_BLOCK)
    assert row == [1, 2]  # positions 0..7
    cm.commit("a", 0, [9])  # c = 8: the next token reads 4..8, block 0 left the window
    step = cm.allocate("a", 1)  # position 8 -> block 2
    delta = step.groups[0]
    assert (delta.start, delta.new_blocks, delta.nulled_range) == (2, (3,), (0, 1))
    delta.apply(row, NULL_BLOCK)
    assert row == cm.block_table("a", 0) == [NULL_BLOCK, 2, 3]
    cm.commit("a", 0, [10])
    cm.check_invariants()


def test_all_mode_checkpoints_every_boundary_of_a_chunk_align_only_the_last():
    """`all`: one prefill chunk leaves a checkpoint at every boundary (8, 16, 24), so a
    prompt that diverges after 18 tokens hits 16; `align` keeps only 24 and misses."""
    for mode, positions, hit in (("all", [8, 16, 24], 16), ("align", [24], 0)):
        cm = CacheManager(toy_plan([FULL4, STATE8], num_blocks=64, state_mode=mode))
        cm.add_request("a", list(range(1, 27)))  # 26 tokens
        cm.lookup("a")
        assert cm.allocate("a", 26) is not None
        slots = cm.state_slots("a", 1)
        assert [pos for pos, _ in slots.checkpoints] == positions
        assert slots.checkpoint == slots.checkpoints[-1]
        cm.commit("a", 0, [99])
        assert cm.stats().num_checkpoints_stored == len(positions)
        cm.add_request("b", [*range(1, 19), 70, 71, 72])
        assert cm.lookup("b") == hit
        cm.check_invariants()


def test_junction_rule_checkpoints_where_a_prompt_leaves_the_cached_prefix():
    """junction: b matches a's cached attention blocks to 16 but no checkpoint <= 16
    exists, so b's prefill checkpoints at 16 too; c, sharing b's first 18 tokens, then
    hits 16. Without the rule c misses."""
    for rules, hit in ((("junction",), 16), ((), 0)):
        cm = CacheManager(toy_plan([FULL4, STATE8], num_blocks=64), checkpoint_rules=rules)
        cm.add_request("a", list(range(1, 27)))
        cm.lookup("a")
        _prefill(cm, "a", 26)
        cm.add_request("b", [*range(1, 19), 70, 71, 72, 73, 74, 75, 76, 77])  # 26 tokens
        assert cm.lookup("b") == 0
        assert cm.allocate("b", 26) is not None
        expected = [16, 24] if rules else [24]
        assert [pos for pos, _ in cm.state_slots("b", 1).checkpoints] == expected
        cm.commit("b", 0, [99])
        cm.add_request("c", [*range(1, 19), 50, 51])
        assert cm.lookup("c") == hit
        cm.check_invariants()
