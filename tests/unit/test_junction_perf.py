"""The per-request speedups of the junction and turn_end rules (issue 25) change no
answer: the shared common-prefix memo (`ChildIndex.memo`), the lookup's reused
``(group, limit)`` answers (`Coordinator.attention_match`), the per-call span cache
(`BlockPool.spans`) and the one-loop child indexing (`note_children`).

Plan: two full attention groups (B 4), a sliding window group (W 6, B 4) and a state
group (interval 4) in one pool, so that several token groups index the same payloads.
Prompts share prefixes and diverge inside blocks (many siblings under one parent)."""

from __future__ import annotations

import random
from array import array

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.cache import CacheManager
from hybridkv.cache.hashing import chain_hash_at
from hybridkv.cache.junction import (
    MAX_CHILDREN_PER_PARENT,
    ChildIndex,
    _common_prefix,
    find_partial,
)
from hybridkv.cache.toy import ToyGroup, toy_plan

B = 4


def _all_children(children: ChildIndex) -> list[list[int]]:
    """Every parent's children, across groups."""
    return [kids for _, _, kids in children.by_parent()]


def _manager(num_blocks: int) -> CacheManager:
    groups = [
        ToyGroup("full", B),
        ToyGroup("sliding", B, span_tokens=6),
        ToyGroup("state", B),
        ToyGroup("full", B),
    ]
    return CacheManager(toy_plan(groups, num_blocks=num_blocks), eviction_policy="chain")


def _common_prefix_tokens(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(
    st.lists(st.integers(0, 2), max_size=40),
    st.lists(st.integers(0, 2), max_size=40),
    st.integers(0, 45),
)
def test_common_prefix_is_exact_whatever_the_hint(a: list[int], b: list[int], hint: int) -> None:
    """A hint (a sibling's answer) only saves compares: any hint gives the exact length."""
    left, right = array("q", a).tobytes(), array("q", b).tobytes()
    expected = _common_prefix_tokens(a, b)
    assert _common_prefix(left, right, hint) == expected
    assert _common_prefix(left, right, expected) == expected
    shared = array("q", [*a, 7]).tobytes()  # a prefix of both: the hint's best case
    assert _common_prefix(shared, array("q", [*a, 8]).tobytes(), len(a)) == len(a)


def _reference_partial(m: CacheManager, g: int, tokens: list[int], anchor: int, limit: int):
    """`find_partial` as first written: every child compared with the prompt's span
    ``[anchor, min(limit, anchor + B - 1, len - 1))`` token by token, no memo."""
    manager = m.coordinator.managers[g]
    children = manager.pool.children
    hashes = m.block_hashes("probe")
    unit = manager.unit_tokens
    if children is None or anchor < 0 or anchor // unit > len(hashes):
        return None
    parent = hashes[anchor // unit - 1] if anchor else m._requests["probe"].root
    entries = {b: children.payload_of[b] for b in children.children_of(g, parent)}
    if not entries:
        return None
    end = min(limit, anchor + B - 1, len(tokens) - 1)
    if end <= anchor:
        return None
    want = tokens[anchor:end]
    best = None
    for block, payload in entries.items():
        length = _common_prefix_tokens(want, array("q", payload).tolist())
        if length and (best is None or anchor + length > best[0]):
            best = (anchor + length, block)
    return best


def _stems(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(50) for _ in range(rng.randrange(5, 14))] for _ in range(3)]


def _prompts(rng: random.Random, stems: list[list[int]], num: int) -> list[list[int]]:
    out = []
    for _ in range(num):
        stem = rng.choice(stems)
        cut = rng.randrange(1, len(stem) + 1)  # diverge anywhere, often inside a block
        out.append(stem[:cut] + [rng.randrange(50, 60) for _ in range(rng.randrange(1, 9))])
    return out


def _serve(m: CacheManager, rid: str, prompt: list[int], rng: random.Random) -> None:
    m.add_request(rid, prompt)
    hit = m.lookup(rid)
    if m.allocate(rid, len(prompt) - hit) is None:
        m.free(rid)
        return
    m.commit(rid, 0, [rng.randrange(60, 70)])
    for _ in range(rng.randrange(0, 4)):  # a few decode steps
        if m.allocate(rid, 1) is None:
            break
        m.commit(rid, 0, [rng.randrange(60, 70)])
    m.free(rid)


def test_find_partial_with_the_shared_memo_matches_the_plain_comparison():
    rng = random.Random(7)
    stems = _stems(rng)
    m = _manager(num_blocks=400)
    for i, prompt in enumerate(_prompts(rng, stems, 60)):
        _serve(m, f"r{i}", prompt, rng)
    m.check_invariants()
    pool = m.coordinator.pools[0]
    assert pool.children is not None and len(pool.children) > 0
    assert max(len(c) for c in _all_children(pool.children)) > 1  # siblings
    token_groups = [g for g, mg in enumerate(m.coordinator.managers) if not mg.is_state]
    checked = 0
    for prompt in _prompts(rng, stems, 40):
        m.add_request("probe", prompt)
        hashes, root = m.block_hashes("probe"), m._requests["probe"].root
        tokens = array("q", prompt)
        # groups and limits in random order: the memo is shared by every group and
        # holds the whole span's prefix, capped per call
        calls = [
            (g, anchor, limit)
            for g in token_groups
            for anchor in range(0, len(prompt), B)
            for limit in range(anchor, len(prompt) + 1)
        ]
        rng.shuffle(calls)
        for g, anchor, limit in calls:
            manager = m.coordinator.managers[g]
            got = find_partial(manager, hashes, root, tokens, anchor, limit)
            assert got == _reference_partial(m, g, prompt, anchor, limit), (g, anchor, limit)
            checked += got is not None
        m.free("probe")
    assert checked > 50  # the comparison found partial hits, not only None


def test_attention_match_reuses_answers_and_equals_the_plain_chain():
    rng = random.Random(11)
    stems = _stems(rng)
    m = _manager(num_blocks=400)
    coordinator = m.coordinator
    for i, prompt in enumerate(_prompts(rng, stems, 40)):
        _serve(m, f"r{i}", prompt, rng)
    for prompt in _prompts(rng, stems, 30):
        m.add_request("probe", prompt)
        m.lookup("probe")
        got = m._junctions["probe"]
        # the plain chain: every token group's max_hit, fresh blocks seen, no answers
        hashes, tokens = m.block_hashes("probe"), array("q", prompt)
        root = m._requests["probe"].root
        match = len(prompt) - 1
        for manager in coordinator.managers:
            if not manager.is_state:
                match = manager.max_hit(hashes, root, tokens, match, {})
        assert got == match
        m.free("probe")
    m.check_invariants()


def test_span_cache_is_open_only_inside_a_coordinator_call():
    rng = random.Random(3)
    stems = _stems(rng)
    m = _manager(num_blocks=400)
    pool = m.coordinator.pools[0]
    for i, prompt in enumerate(_prompts(rng, stems, 20)):
        m.add_request(f"r{i}", prompt)
        hit = m.lookup(f"r{i}")
        assert pool.spans is None
        assert m.allocate(f"r{i}", len(prompt) - hit) is not None
        m.commit(f"r{i}", 0, [61])
        assert pool.spans is None
        m.free(f"r{i}")
        assert pool.spans is None
    m.check_invariants()


def test_children_payloads_are_the_blocks_tokens_and_bounded_per_parent():
    # one stem, many continuations diverging at token 6 (inside block 1): block 2 of
    # each is a child of the same parent (hash at 8) in both full groups
    rng = random.Random(5)
    m = _manager(num_blocks=600)
    stem = [rng.randrange(50) for _ in range(6)]
    prompts = [stem + [100 + i] * 9 for i in range(MAX_CHILDREN_PER_PARENT + 4)]
    for i, prompt in enumerate(prompts):
        _serve(m, f"r{i}", prompt, rng)
    m.check_invariants()
    children = m.coordinator.pools[0].children
    assert children is not None
    assert max(len(c) for c in _all_children(children)) == MAX_CHILDREN_PER_PARENT
    by_hash = {}
    for prompt in prompts:
        m.add_request("probe", prompt)
        hashes, root = m.block_hashes("probe"), m._requests["probe"].root
        for j in range(len(hashes)):
            parent = chain_hash_at(hashes, root, B, j * B)
            by_hash[parent] = by_hash.get(parent, set()) | {tuple(prompt[j * B : (j + 1) * B])}
        m.free("probe")
    seen = 0
    for _, parent, kids in children.by_parent():
        for block in kids:
            payload = children.payload_of[block]
            assert len(payload) == 8 * B
            if parent in by_hash:
                assert tuple(array("q", payload)) in by_hash[parent]
                seen += 1
    assert seen > 0
