"""The ``turn_end`` checkpoint rule (`hybridkv.cache.turn_end`): a released request keeps
its partial last block and its state at its last computed token; the next turn of the
session resumes there, taking the partial block over."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.cache import CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.cache.turn_end import _longest_prefix
from hybridkv.errors import CacheError

F4, S8 = ToyGroup("full", 4), ToyGroup("state", 8)
PROMPT = list(range(100, 110))  # 10 tokens
OUTPUT = [7, 8, 9, 6]  # 4 tokens: the request ends with 14 tokens, 13 computed


def _manager(rules=("turn_end",), groups=(F4, S8), eagle=False, **plan_kwargs) -> CacheManager:
    plan = toy_plan(list(groups), num_blocks=plan_kwargs.pop("num_blocks", 40), **plan_kwargs)
    return CacheManager(plan, checkpoint_rules=rules, eagle=eagle)


def _run_turn(cm: CacheManager, req: str, prompt: list[int], output: list[int]) -> int:
    """Admit ``req``, prefill in one chunk, decode ``output`` one token a step, free.
    Returns the prefix hit."""
    cm.add_request(req, prompt)
    hit = cm.lookup(req)
    assert cm.allocate(req, len(prompt) - hit) is not None
    cm.commit(req, 0, [output[0]])
    for token in output[1:]:
        assert cm.allocate(req, 1) is not None
        cm.commit(req, 0, [token])
    cm.check_invariants()
    cm.free(req)
    cm.check_invariants()
    return hit


def test_next_turn_resumes_at_the_last_computed_token_and_takes_the_block_over():
    """Turn 1 computes 13 of its 14 tokens (the last sampled token never is). Turn 2's
    prompt extends all 14: it hits 13 (block-granular: 8, the state checkpoint), its
    table's 4th block is turn 1's partial block, no longer cached, written from 13."""
    for rules, expected in ((("turn_end",), 13), ((), 8)):
        cm = _manager(rules)
        _run_turn(cm, "t1", PROMPT, OUTPUT)
        turn2 = PROMPT + OUTPUT + [1, 2, 3]
        cm.add_request("t2", turn2)
        assert cm.lookup("t2") == expected
        if rules:
            partial = [i for i in range(1, 40) if cm.block_info(0, i).block_hash is not None]
            entry = [b for b in partial if cm.coordinator.pools[0].hash_end[b] == 13]
            assert len(entry) == 2  # the attention block and the state at 13
        assert cm.allocate("t2", len(turn2) - expected) is not None
        table = cm.block_table("t2", 0)
        assert len(table) == 5  # 17 tokens in blocks of 4
        if rules:
            block = table[3]  # positions 12..15: turn 1's partial block, taken over
            info = cm.block_info(0, block)
            assert info.ref_count == 1 and info.block_hash is None
            slots = cm.state_slots("t2", 1)
            assert slots.num_computed_tokens == 13 and slots.read_block is not None
            assert cm.coordinator.pools[0].num_takeovers == 1
        cm.commit("t2", 0, [5])
        cm.check_invariants()


def test_a_partial_hit_needs_an_exact_token_match_inside_the_block():
    """Same chain up to the anchor (12), a different token inside the partial block:
    no turn-end hit (the block hit stops at the state checkpoint at 8)."""
    cm = _manager()
    _run_turn(cm, "t1", PROMPT, OUTPUT)
    other = PROMPT + OUTPUT[:2] + [999, 1, 2]  # token 12 differs
    cm.add_request("o", other)
    assert cm.lookup("o") == 8
    shorter = PROMPT + OUTPUT[:2] + [1]  # a prefix of the entry's tokens only (12 < 13)
    cm.add_request("s", shorter)
    assert cm.lookup("s") == 8  # entries end at 13 > the 12 tokens a hit may take


def test_two_requests_racing_for_one_partial_block():
    """Both look the entry up; the first admission takes the block over; the second
    allocate sees the takeover, fails without changing anything, and its next lookup
    stops at the block boundary."""
    cm = _manager()
    _run_turn(cm, "t1", PROMPT, OUTPUT)
    nxt = PROMPT + OUTPUT + [1, 2]
    for req in ("a", "b"):
        cm.add_request(req, nxt)
        assert cm.lookup(req) == 13
    assert cm.allocate("a", len(nxt) - 13) is not None
    free_before = cm.num_free_blocks()
    assert cm.allocate("b", len(nxt) - 13) is None
    assert cm.num_free_blocks() == free_before
    cm.check_invariants()
    assert cm.lookup("b") == 8
    assert cm.allocate("b", len(nxt) - 8) is not None
    cm.check_invariants()


def test_entries_are_evicted_like_blocks_and_leave_the_anchor_table():
    cm = _manager(num_blocks=16)  # 15 usable
    _run_turn(cm, "t1", PROMPT, OUTPUT)
    pool = cm.coordinator.pools[0]
    assert pool.partial is not None and len(pool.partial) == 2
    big = list(range(500, 553))  # 52 computed: 13 attention blocks + 2 states: all 15
    cm.add_request("big", big)
    cm.lookup("big")
    assert cm.allocate("big", 52) is not None
    cm.check_invariants()
    assert len(pool.partial) == 0 and not any(pool.partial.only.values())
    assert not any(pool.partial.many.values())
    cm.add_request("t2", PROMPT + OUTPUT + [1])
    assert cm.lookup("t2") == 0


def test_not_kept_when_released_mid_step_or_on_a_boundary():
    """A request freed with a step in flight (its running state may be half written)
    keeps nothing; one that ends on a block boundary needs no entry."""
    cm = _manager()
    cm.add_request("x", PROMPT)
    cm.lookup("x")
    assert cm.allocate("x", 10) is not None
    cm.free("x")  # pending step
    assert len(cm.coordinator.pools[0].partial) == 0
    cm.add_request("y", list(range(300, 308)))  # computes 8 tokens, then frees
    cm.lookup("y")
    cm.allocate("y", 8)
    cm.commit("y", 0, [1])
    cm.free("y")
    assert len(cm.coordinator.pools[0].partial) == 0
    cm.check_invariants()


def test_preempted_request_resumes_from_its_own_turn_end():
    cm = _manager()
    cm.add_request("p", PROMPT)
    cm.lookup("p")
    cm.allocate("p", 10)
    cm.commit("p", 0, [1])
    cm.allocate("p", 1)
    cm.commit("p", 0, [2])  # 11 computed, 12 tokens
    cm.preempt("p")
    assert cm.lookup("p") == 11
    assert cm.allocate("p", 1) is not None
    cm.check_invariants()


def test_groups_keyed_ahead_match_the_next_token_too():
    """EAGLE / MTP head groups key a block with the token after it; a turn-end entry
    too: the same 13 tokens followed by another token miss the head group's entry."""
    groups = (F4, S8, ToyGroup("full", 4, model="draft"))
    cm = _manager(groups=groups, eagle=True, num_spec_tokens=2)
    _run_turn(cm, "t1", PROMPT, OUTPUT)
    same = PROMPT + OUTPUT + [1]
    cm.add_request("same", same)
    assert cm.lookup("same") == 13
    other = PROMPT + OUTPUT[:3] + [OUTPUT[3] + 1, 1]  # same 13 tokens, another 14th
    cm.add_request("other", other)
    assert cm.lookup("other") == 8  # the head group's entry misses: the state's 8
    cm.check_invariants()


def test_rule_name_and_unknown_rules():
    plan = toy_plan([F4, S8])
    assert CacheManager(plan, checkpoint_rules=("junction", "turn_end")).checkpoint_rules == (
        "junction",
        "turn_end",
    )
    with pytest.raises(CacheError, match=r"\['turn-end'\] are unknown.*turn_end"):
        CacheManager(plan, checkpoint_rules=("turn-end",))


def test_junction_with_turn_end_checkpoints_at_the_attention_match_inside_an_interval():
    """split: attention blocks of 4, state interval 8. A computed 14 tokens; B shares
    its first 12 then diverges: attention matches 12, the state only 8. With turn_end
    the junction checkpoint goes at 12 itself (without: at 8), so C hits 12."""
    shared = list(range(200, 212))
    for rules, expected in ((("junction", "turn_end"), 12), (("junction",), 8)):
        cm = _manager(rules, layout="split")
        _run_turn(cm, "a", [*shared, 1, 2], [3])
        b = [*shared, 50, 51, 52, 53, 54]
        _run_turn(cm, "b", b, [4])
        cm.add_request("c", [*shared, 60, 61])
        assert cm.lookup("c") == expected
        assert cm.allocate("c", 2 + 12 - expected) is not None
        cm.check_invariants()


# -- ends inside the first block: entries anchored at the chain's root ----------------


def _serve_turn(
    cm: CacheManager, req: str, prompt: list[int], output: list[int], **keys: object
) -> int:
    """`_run_turn` with the request's extra keys (cache salt, LoRA id)."""
    cm.add_request(req, prompt, **keys)  # type: ignore[arg-type]
    hit = cm.lookup(req)
    assert cm.allocate(req, len(prompt) - hit) is not None
    for token in output:
        cm.commit(req, 0, [token])
        if token != output[-1]:
            assert cm.allocate(req, 1) is not None
    cm.check_invariants()
    cm.free(req)
    cm.check_invariants()
    return hit


def _hybrid(attention_tokens: int, interval_tokens: int, layout: str = "shared") -> CacheManager:
    groups = [ToyGroup("full", attention_tokens), ToyGroup("state", interval_tokens)]
    return CacheManager(toy_plan(groups, num_blocks=64, layout=layout))  # default rules


@pytest.mark.parametrize(
    ("attention_tokens", "interval_tokens", "layout"),
    [(256, 256, "shared"), (16, 16, "shared"), (16, 64, "split")],
)
@pytest.mark.parametrize("first_end", [5, 15, 40, 100, 200, 250])
def test_turns_ending_inside_the_first_block_resume_at_the_token_exact_bound(
    attention_tokens: int, interval_tokens: int, layout: str, first_end: int
) -> None:
    """A chat whose first turn ends ``first_end`` tokens in (inside the first block at
    B 256, where block-granular caching hits 0): every next turn (previous prompt +
    output + 20 user tokens) hits exactly the previous context minus its last token,
    which no step computed. Turn 2 resumes from entries anchored at the chain's root;
    turn 3 from the root or from the next block's boundary."""
    cm = _hybrid(attention_tokens, interval_tokens, layout)
    prompt = [1000 + i for i in range(first_end - 3)]
    bound = 0
    for turn in range(3):
        output = [10 + turn, 20 + turn, 30 + turn]
        assert _serve_turn(cm, f"t{turn}", prompt, output) == bound
        bound = len(prompt) + len(output) - 1
        prompt = prompt + output + [2000 + 20 * turn + i for i in range(20)]


def test_root_entries_never_cross_cache_salts_or_lora_ids() -> None:
    """The root digests the extra keys that key the first block, so a turn-end entry
    inside it serves only the same cache salt and LoRA id: the same tokens under
    another tenant hit 0 and keep an entry of their own."""
    cm = _hybrid(256, 256)
    prompt, output = list(range(100, 197)), [7, 8, 9]  # context 100: 99 computed
    nxt = prompt + output + [1, 2, 3]
    _serve_turn(cm, "a", prompt, output, cache_salt="tenant a")
    probes = [
        ({"cache_salt": "tenant a"}, 99),
        ({"cache_salt": "tenant b"}, 0),
        ({}, 0),
        ({"cache_salt": "tenant a", "lora_id": 1}, 0),
    ]
    for i, (keys, expected) in enumerate(probes):
        cm.add_request(f"probe{i}", nxt, **keys)  # type: ignore[arg-type]
        assert cm.lookup(f"probe{i}") == expected, keys
        cm.free(f"probe{i}")
    _serve_turn(cm, "b", prompt, output, cache_salt="tenant b")
    partial = cm.coordinator.pools[0].partial
    assert partial is not None and len(partial) == 4  # 2 tenants x (attention, state)
    assert all(len(anchors) == 2 for anchors in partial.only.values())  # one root each
    for salt in ("tenant a", "tenant b"):
        cm.add_request(salt, nxt, cache_salt=salt)
        assert cm.lookup(salt) == 99
    cm.check_invariants()


def test_eight_sessions_sharing_a_system_prompt_resume_at_their_own_ends() -> None:
    """B 256, a 200-token system prompt, first prompts of 40..250 tokens (those under
    200 a head of it), 5 output tokens: every first turn ends inside the first block,
    so all 8 sessions' entries hang off one root, most of them sharing 200 tokens. Each
    session's next turn finds its own entry (bisection over the sorted keys) and hits
    exactly its bound; so does the turn after."""
    cm = _hybrid(256, 256)
    system = [5000 + i for i in range(200)]
    lengths = [40, 100, 200, 210, 220, 230, 240, 250]
    prompts = [(system + [6000 + 64 * s + i for i in range(64)])[:n] for s, n in enumerate(lengths)]
    bounds = [0] * len(prompts)
    for turn in range(3):
        for s, prompt in enumerate(prompts):
            output = [100 + s, 200 + turn, 300 + s]
            assert _serve_turn(cm, f"s{s}t{turn}", prompt, output) == bounds[s], (s, turn)
            bounds[s] = len(prompt) + len(output) - 1
            prompts[s] = prompt + output + [7000 + 30 * s + i for i in range(30)]
        if turn == 0:
            partial = cm.coordinator.pools[0].partial
            assert partial is not None and len(partial) == 2 * len(prompts)
            assert [len(keys) for keys in partial.many[0].values()] == [len(prompts)]


def test_sessions_sharing_a_system_prompt_shorter_than_a_block_hit_it_by_a_copy() -> None:
    """Junction rule at the root: A's first turn fills block 0 (cached: a child of the
    root); B shares only the 200-token system prompt, hits nothing (no state at 200
    yet) and checkpoints its state there; C then hits 200 with A's block 0's first 200
    slots copied into a fresh block. Another cache salt hits nothing."""
    cm = _hybrid(256, 256)
    system = [5000 + i for i in range(200)]
    cm.add_request("A", [*system, *range(1, 101)])
    cm.lookup("A")
    assert cm.allocate("A", 300) is not None
    source = cm.block_table("A", 0)[0]
    cm.commit("A", 0, [7])
    cm.free("A")
    b = [*system, *range(101, 151)]
    cm.add_request("B", b)
    assert cm.lookup("B") == 0
    assert cm.allocate("B", len(b)) is not None
    assert [pos for pos, _ in cm.state_slots("B", 1).checkpoints] == [200]
    cm.commit("B", 0, [7])
    cm.free("B")
    c = [*system, *range(201, 251)]
    cm.add_request("D", c, cache_salt="other")
    assert cm.lookup("D") == 0
    cm.add_request("C", c)
    assert cm.lookup("C") == 200
    delta = cm.allocate("C", len(c) - 200)
    assert delta is not None
    (order,) = delta.copies
    assert (order.group_id, order.src_block, order.num_tokens) == (0, source, 200)
    assert order.dst_block == cm.block_table("C", 0)[0] != source
    cm.check_invariants()


@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=12),
    st.lists(st.integers(0, 3), max_size=7),
)
def test_longest_prefix_bisection_equals_a_scan(entries: list[list[int]], want: list[int]):
    """`_longest_prefix` over sorted keys (a head, then 8 bytes a token) answers as a
    scan of every key for the longest one that prefixes the wanted tokens."""
    head = b"h" * 5  # not a multiple of 8: token bytes never align with the key's start
    keys = sorted({head + array("q", e).tobytes() for e in entries})
    query = head + array("q", want).tobytes()
    prefixes = [k for k in keys if query.startswith(k)]
    expected = max(prefixes, key=len) if prefixes else None
    assert _longest_prefix(keys, query, len(head)) == expected
