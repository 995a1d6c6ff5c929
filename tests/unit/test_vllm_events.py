"""hybridkv's cache events as vLLM's KV-cache events (`hybridkv.vllm.events`), without vLLM.

vLLM's side is a stand-in schema: event classes with vLLM's field names and a sha256
chain in vLLM's shape (one hash per unit over the whole prefix; a block of ``B`` tokens
keyed by the chain at its end). A router model (`tests.kv_event_index`) rebuilds the
index from the events alone and must predict every prefix hit the facade answers.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

import pytest
from tests.kv_event_index import EventIndex

from hybridkv.cache.events import BLOCK_REMOVED, BLOCK_STORED, CacheEvent
from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId
from hybridkv.vllm.events import EventSchema, GroupMeta, VllmEventLog
from hybridkv.vllm.kv_manager import VllmKVCacheManager
from hybridkv.vllm.kv_plan import VllmGroup
from hybridkv.vllm.rows import split_prefill_chunk


# ---------------------------------------------------------------- vLLM stand-ins
@dataclass
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    session_id: str | None = None


@dataclass
class OldBlockStored:
    """An older schema: no group or spec fields (they must be left out, not fail)."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


@dataclass
class BlockRemoved:
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


@dataclass
class AllBlocksCleared:
    pass


def tail_hash(parent: bytes | None, tokens: Any, extra: Any = None) -> bytes:
    return sha256(repr((parent or b"root", tuple(tokens), extra)).encode()).digest()


def external(h: bytes) -> int:  # vLLM's int form: the low 64 bits, big-endian
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def chain(tokens: Any, unit: int) -> list[bytes]:
    out: list[bytes] = []
    for start in range(0, len(tokens) // unit * unit, unit):
        out.append(tail_hash(out[-1] if out else None, tokens[start : start + unit]))
    return out


def schema(unit: int, stored_cls: Any = BlockStored) -> EventSchema:
    return EventSchema(
        stored_cls=stored_cls,
        removed_cls=BlockRemoved,
        cleared_cls=AllBlocksCleared,
        hash_unit_tokens=unit,
        external_hash=external,
        tail_hash=tail_hash,
        extra_keys=lambda request, start, end: None,
        event_extra_keys=lambda keys: None if not any(keys) else keys,
    )


@dataclass
class FakeRequest:
    """The fields of vLLM's Request the facade and the event log read."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    max_new: int
    unit: int
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    lora_request: Any = None
    cache_salt: str | None = None
    produced: int = 0
    _hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:  # vLLM's hasher: every full unit, kept current
        if len(self._hashes) != len(self.all_token_ids) // self.unit:
            self._hashes = chain(self.all_token_ids, self.unit)
        return self._hashes


class Blocks:
    def __init__(self, blocks: tuple) -> None:
        self.blocks = blocks


def as_dict(event: Any) -> dict[str, Any]:
    return {"type": type(event).__name__, **dataclasses.asdict(event)}


def index_for(groups: list[VllmGroup], unit: int) -> EventIndex:
    kinds = {"full": "full_attention", "state": "mamba"}
    meta = [
        {"group_idx": g.group_id, "kind": kinds[g.kind], "block_size": g.block_size} for g in groups
    ]
    return EventIndex(meta, unit, lambda p: chain(p, unit), tail_hash, external)


def event_log(groups: list[VllmGroup], unit: int) -> VllmEventLog:
    kinds = {"full": "full_attention", "state": "mamba"}
    return VllmEventLog(schema(unit), [GroupMeta(g.block_size, kinds[g.kind]) for g in groups])


# ---------------------------------------------------------------- translation
def _req(tokens: list[int], unit: int = 4) -> FakeRequest:
    return FakeRequest("r", tokens, len(tokens), 1, unit)


def _stored(group: int, end: int, key: bytes = b"", block: int = 1) -> CacheEvent:
    return CacheEvent(BLOCK_STORED, group, BlockId(block), key or end.to_bytes(4, "little"), end)


def _removed(group: int, end: int, key: bytes = b"", block: int = 1) -> CacheEvent:
    return CacheEvent(BLOCK_REMOVED, group, BlockId(block), key or end.to_bytes(4, "little"), end)


def test_full_blocks_take_vllm_chain_at_their_end() -> None:
    """Blocks of 8 over a unit of 4: keys are the chain at 8 and 16 (h2, h4), parent
    None then h2; one event for the consecutive run; tokens == blocks x block size."""
    req = _req(list(range(1, 21)))
    log = VllmEventLog(schema(4), [GroupMeta(8, "full_attention")])
    log.record([_stored(0, 8), _stored(0, 16)], req)
    (event,) = log.take()
    h = req.block_hashes
    assert event.block_hashes == [external(h[1]), external(h[3])]
    assert event.parent_block_hash is None
    assert event.token_ids == list(range(1, 17))
    assert (event.block_size, event.group_idx, event.kv_cache_spec_kind) == (8, 0, "full_attention")
    assert event.medium == "GPU"


def test_state_checkpoints_skip_no_span() -> None:
    """A state group stores only checkpoints: 8 and 24 (not 16) are two events, each
    over its own 8 tokens, parents the chain at 0 (None) and at 16 (never stored in the
    group: a state needs no parent); never stock's tokens over the skipped block."""
    req = _req(list(range(1, 30)))
    log = VllmEventLog(schema(4), [GroupMeta(8, "mamba")])
    log.record([_stored(0, 8), _stored(0, 24, block=2)], req)
    first, second = log.take()
    h = req.block_hashes
    assert first.block_hashes == [external(h[1])] and first.token_ids == list(range(1, 9))
    assert second.block_hashes == [external(h[5])]
    assert second.parent_block_hash == external(h[3])
    assert second.token_ids == list(range(17, 25))
    for event in (first, second):
        assert len(event.token_ids) == len(event.block_hashes) * event.block_size


def test_turn_end_entries_off_and_on_the_unit() -> None:
    """A turn end at 19 (unit 4, block 8): tokens 16..18 after the chain at 16, keyed by
    vLLM's hash of that tail; at 12 (on the unit, inside a block): vLLM's own partial
    shape, the chain at 12 over the unit before it."""
    tokens = list(range(1, 30))
    req = _req(tokens)
    log = VllmEventLog(schema(4), [GroupMeta(8, "mamba")])
    log.record([_stored(0, 19, b"turn-end-19"), _stored(0, 12, b"turn-end-12", 2)], req)
    off, on = log.take()
    h = req.block_hashes
    assert off.block_hashes == [external(tail_hash(h[3], tokens[16:19]))]
    assert (off.parent_block_hash, off.token_ids, off.block_size) == (
        external(h[3]),
        tokens[16:19],
        3,
    )
    assert on.block_hashes == [external(h[2])]
    assert (on.parent_block_hash, on.token_ids, on.block_size) == (external(h[1]), tokens[8:12], 4)


def test_turn_end_in_the_first_unit_has_no_parent() -> None:
    tokens = list(range(1, 10))
    log = VllmEventLog(schema(4), [GroupMeta(8, "full_attention")])
    log.record([_stored(0, 3, b"turn-end-3")], _req(tokens))
    (event,) = log.take()
    assert event.parent_block_hash is None
    assert event.block_hashes == [external(tail_hash(None, tokens[:3]))]


def test_runs_split_around_a_tail_entry() -> None:
    """Blocks 8 and 16 of a group with a tail entry stored between them: three events
    in order, each consistent (a run never spans an entry of another shape)."""
    req = _req(list(range(1, 30)))
    log = VllmEventLog(schema(4), [GroupMeta(8, "mamba")])
    log.record([_stored(0, 8), _stored(0, 13, b"junction-13", 2), _stored(0, 16, block=3)], req)
    events = log.take()
    assert [(e.token_ids[0], e.block_size) for e in events] == [(1, 8), (13, 1), (9, 8)]


def test_removal_uses_the_published_key_and_merges_per_group() -> None:
    req = _req(list(range(1, 30)))
    log = VllmEventLog(schema(4), [GroupMeta(8, "full_attention"), GroupMeta(8, "mamba")])
    log.record([_stored(0, 8), _stored(0, 16, block=2), _stored(1, 16, block=3)], req)
    stored = log.take()
    log.record([_removed(0, 16, block=2), _removed(0, 8), _removed(1, 16, block=3)], None)
    removed = log.take()
    assert [type(e).__name__ for e in removed] == ["BlockRemoved", "BlockRemoved"]
    assert removed[0].block_hashes == list(reversed(stored[0].block_hashes))
    assert (removed[1].group_idx, removed[1].block_hashes) == (1, stored[1].block_hashes)
    log.check_invariants()
    assert log.num_published == 4


def test_two_blocks_under_one_vllm_key_are_announced_once() -> None:
    """hybridkv keys a multimodal request by every image; vLLM only the blocks an image
    overlaps: two cached blocks may share a vLLM key. Stored once, removed with the last."""
    req = _req(list(range(1, 20)))
    log = VllmEventLog(schema(4), [GroupMeta(8, "full_attention")])
    log.record([_stored(0, 8, b"a"), _stored(0, 8, b"b", block=2)], req)
    assert len(log.take()) == 1
    log.record([_removed(0, 8, b"a")], None)
    assert log.take() == []
    log.record([_removed(0, 8, b"b", block=2)], None)
    assert [type(e).__name__ for e in log.take()] == ["BlockRemoved"]
    log.check_invariants()


def test_blocks_off_a_coarser_vllm_unit_are_not_published() -> None:
    """vLLM hashes at 16 (a state group outside align mode): blocks of 8 have no vLLM
    key of their own (a block's start is off the unit); their removal publishes nothing."""
    req = _req(list(range(1, 40)), unit=16)
    log = VllmEventLog(schema(16), [GroupMeta(8, "full_attention")])
    log.record([_stored(0, 8), _stored(0, 16, block=2)], req)
    assert log.take() == []
    assert log.num_unpublished_blocks == 2
    log.record([_removed(0, 8)], None)
    assert log.take() == []


def test_stored_outside_a_request_is_an_invariant_error() -> None:
    log = VllmEventLog(schema(4), [GroupMeta(8, "full_attention")])
    with pytest.raises(InvariantError, match="outside a request"):
        log.record([_stored(0, 8)], None)


def test_older_schema_gets_only_its_fields() -> None:
    req = _req(list(range(1, 20)))
    log = VllmEventLog(schema(4, OldBlockStored), [GroupMeta(8, "full_attention")])
    log.record([_stored(0, 8)], req)
    (event,) = log.take()
    assert isinstance(event, OldBlockStored) and event.block_size == 8


def test_clear_forgets_every_block() -> None:
    req = _req(list(range(1, 20)))
    log = VllmEventLog(schema(4), [GroupMeta(8, "full_attention")])
    log.record([_stored(0, 8)], req)
    log.clear()
    log.record([_removed(0, 8)], None)  # an eviction of the old cache: already cleared
    assert [type(e).__name__ for e in log.take()] == ["BlockStored", "AllBlocksCleared"]
    log.check_invariants()


# ---------------------------------------------------------------- through the facade
def _manager(groups: list[VllmGroup], num_blocks: int, unit: int, events: bool = True):
    return VllmKVCacheManager(
        groups,
        num_blocks=num_blocks,
        enable_caching=True,
        state_mode="align",
        num_spec_tokens=0,
        blocks_cls=Blocks,
        events=event_log(groups, unit) if events else None,
    )


def _serve(
    kv: VllmKVCacheManager,
    index: EventIndex,
    *,
    sessions: int = 0,
    num_turns: int = 0,
    seed: int = 0,
    shared: int = 0,
    budget: int = 64,
) -> list[tuple[int, int]]:
    """vLLM's scheduler loop in miniature (FCFS admission under a token budget, chunks
    split where hybridkv checkpoints, the newest preempted when a step does not fit,
    multi-turn sessions). Before each lookup the index takes the events published so far
    and predicts the hit; returns (predicted, answered) per lookup."""
    rng = random.Random(seed)
    unit = index.hash_unit_tokens
    B = min(g.block_size for g in kv.groups if g.kind == "state")
    system = [rng.randrange(1, 40) for _ in range(shared)]
    contexts = [
        system + [rng.randrange(1, 40) for _ in range(rng.randrange(3, 30))]
        for _ in range(sessions)
    ]
    seen: list[tuple[int, int]] = []

    def drain() -> None:
        for event in kv.take_events():
            index.apply(as_dict(event))

    for turn in range(num_turns):
        waiting = [
            FakeRequest(f"s{i}t{turn}", list(ctx), len(ctx), rng.randrange(1, 12), unit)
            for i, ctx in enumerate(contexts)
        ]
        running: list[FakeRequest] = []
        steps = 0
        while waiting or running:
            steps += 1
            assert steps < 2000
            kv.settle({r.request_id: r for r in running + waiting})
            kv.new_step_starts()
            scheduled: list[tuple[FakeRequest, int]] = []
            left = budget
            for req in list(running):
                if req not in running:
                    continue
                n = min(req.num_tokens - req.num_computed_tokens, left)
                n = split_prefill_chunk(
                    req.num_computed_tokens, n, req.num_prompt_tokens, B, kv.junction_point(req)
                )
                if n <= 0:
                    continue
                while kv.allocate_slots(req, n) is None:
                    victim = running.pop()
                    kv.free(victim)
                    victim.num_computed_tokens = 0
                    victim.num_preemptions += 1
                    waiting.insert(0, victim)
                    scheduled = [(r, m) for r, m in scheduled if r is not victim]
                    if victim is req:
                        break
                else:
                    scheduled.append((req, n))
                    left -= n
            while waiting and left > 0:
                req = waiting[0]
                drain()
                _, hit, _ = kv.get_computed_blocks(req)
                seen.append((index.predict(req.all_token_ids), hit))
                n = min(req.num_tokens - hit, left)
                n = split_prefill_chunk(hit, n, req.num_prompt_tokens, B, kv.junction_point(req))
                if kv.allocate_slots(req, n, num_new_computed_tokens=hit) is None:
                    break
                waiting.pop(0)
                req.num_computed_tokens = hit
                running.append(req)
                scheduled.append((req, n))
                left -= n
            kv.take_kv_cache_block_copies()
            for req, n in scheduled:
                req.num_computed_tokens += n
            kv.mark_executed()
            for req, _ in scheduled:
                if req.num_computed_tokens < req.num_tokens:
                    continue
                req.all_token_ids.append(rng.randrange(1, 40))
                req.produced += 1
                if req.produced >= req.max_new:
                    running.remove(req)
                    kv.free(req)
                    i = int(req.request_id[1:].split("t")[0])
                    contexts[i] = req.all_token_ids + [rng.randrange(1, 40) for _ in range(4)]
            drain()
            kv.check_invariants()
            assert kv.events is not None
            kv.events.check_invariants()
    return seen


GEOMETRIES = {
    "same blocks": ([VllmGroup(0, "full", 8), VllmGroup(1, "state", 8)], 8),
    "state every 16": ([VllmGroup(0, "full", 8), VllmGroup(1, "state", 16)], 8),
}


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("num_blocks", [400, 40])
def test_router_predicts_every_hit(geometry: str, num_blocks: int) -> None:
    """Multi-turn chat with a shared system prompt: a router that knows only the events
    and vLLM's hashing predicts every hit the facade answers (turn ends, junction
    copies and checkpoints, evictions under a small pool)."""
    groups, unit = GEOMETRIES[geometry]
    kv = _manager(groups, num_blocks, unit)
    index = index_for(groups, unit)
    seen = _serve(kv, index, sessions=6, num_turns=4, seed=num_blocks, shared=21)
    assert [p for p, _ in seen] == [h for _, h in seen]
    assert sum(h for _, h in seen) > 0
    assert kv.events is not None and kv.events.num_published == index.num_events
    if num_blocks == 40:
        assert kv.cache.stats().num_evictions > 0


def test_reset_publishes_all_cleared() -> None:
    groups, unit = GEOMETRIES["same blocks"]
    kv = _manager(groups, 200, unit)
    index = index_for(groups, unit)
    _serve(kv, index, sessions=3, num_turns=2, seed=4)
    assert any(index.entries.values())
    assert kv.reset_prefix_cache()
    (event,) = kv.take_events()
    index.apply(as_dict(event))
    assert event == AllBlocksCleared() and not any(index.entries.values())


def test_no_events_no_recording() -> None:
    """Without a log (vLLM not asked for events) hybridkv records nothing."""
    groups, unit = GEOMETRIES["same blocks"]
    kv = _manager(groups, 200, unit, events=False)
    assert all(pool.events is None for pool in kv.cache.coordinator.pools)
    assert kv.take_events() == []
