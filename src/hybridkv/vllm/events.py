"""hybridkv's cache events as vLLM's KV-cache events (``--kv-events-config``), so that
prefix-aware routers (llm-d's KV-cache indexer, Dynamo's KV router) can index a vLLM
engine that runs ``--scheduler-cls hybridkv.vllm.Scheduler``.

hybridkv keys blocks by its own chain (`hybridkv.cache.hashing`); a router recomputes
vLLM's keys from a prompt's token ids. So every stored block is published under vLLM's
hash of the same prefix: vLLM's request carries its hasher's chain
(``request.block_hashes``, one hash per ``H = hash_block_size`` tokens, each over the
whole prefix), and in vLLM 0.32 and 0.33 a block of ``B`` tokens (a multiple of ``H``)
ending at position ``e`` is keyed by the chain hash at ``e`` (vLLM's
``BlockHashListWithBlockSize``)::

    H = 4, B = 8         tokens |0 ..  3|4 ..  7|8 .. 11|12 .. 15|16 17 18
    request.block_hashes         h1      h2      h3      h4
    full block [8, 16)      -> block_hashes [h4], parent h2, token_ids t8..t15, block_size 8
    state checkpoint at 16  -> the same shape in the state group (stored only where
                               a checkpoint exists: its parent need not be stored there)
    turn end at 19 (c % B)  -> p = 16 (c // H * H): block_hashes [T], parent h4,
                               token_ids t16..t18, block_size 3, T = vLLM's hash of a
                               block holding t16..t18 after h4 (its ``hash_block_tokens``)
    turn end at 12          -> c is on the chain: [h3], parent h2, t8..t11, block_size 4
                               (the shape of vLLM's own partial entries)

Every event keeps ``len(token_ids) == len(block_hashes) * block_size`` (stock vLLM's
state-group events do not). Hashes go out as vLLM publishes them (64-bit ints by
default, ``maybe_convert_block_hash``), with vLLM's extra keys, LoRA fields, the
group's spec kind and window, and the medium. A block whose end is not on vLLM's hash
unit (possible only when vLLM hashes coarser than a group's blocks: state groups
outside align mode) has no vLLM key and is not published (``num_unpublished_blocks``).

Removal needs the published hash after the request is gone, so the log remembers it
per cached block; two cached blocks under one vLLM key (hybridkv keys multimodal
requests by every image of the request, vLLM only the blocks an image overlaps) are
announced once and removed when the last goes.

vLLM's side comes in as an `EventSchema` (`vllm_event_log` builds it from the running
vLLM); nothing here imports vLLM, so the translation is tested without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.cache.events import BLOCK_REMOVED, CacheEvent
from hybridkv.errors import InvariantError
from hybridkv.vllm.kv_plan import VllmGroup

ExternalHash = int | bytes  # vLLM's ExternalBlockHash


@dataclass(frozen=True)
class EventSchema:
    """vLLM's event classes and hashing, as the running vLLM defines them.

    ``external_hash``: a chain hash as vLLM publishes it; ``tail_hash(parent, tokens,
    extra_keys)``: vLLM's hash of one block of ``tokens`` after ``parent`` (None: the
    first block); ``extra_keys(request, start, end)``: vLLM's extra keys of a token
    span; ``event_extra_keys``: the per-block list as events carry it."""

    stored_cls: Any
    removed_cls: Any
    cleared_cls: Any
    hash_unit_tokens: int  # vLLM's hash_block_size
    external_hash: Callable[[bytes], ExternalHash]
    tail_hash: Callable[[bytes | None, Sequence[int], Any], bytes]
    extra_keys: Callable[[Any, int, int], Any]
    event_extra_keys: Callable[[list[Any]], Any]
    medium: str = "GPU"


@dataclass(frozen=True)
class GroupMeta:
    """What a router learns about a group from its stored events."""

    block_size: int
    spec_kind: str | None = None  # vLLM's KVCacheSpecKind value
    sliding_window: int | None = None


def _field_names(cls: Any) -> frozenset[str]:
    """The fields an event class of the installed vLLM has (msgspec struct or dataclass)."""
    names = getattr(cls, "__struct_fields__", None)
    if names is None:
        names = [f.name for f in dataclasses.fields(cls)]
    return frozenset(names)


class VllmEventLog:
    """Translates hybridkv's events into vLLM's as they happen; `take` hands them out.

    Stored blocks come only from a request's commit or release, so `record` gets them
    with that request (its token ids and vLLM chain); removals need none.
    """

    def __init__(self, schema: EventSchema, groups: Sequence[GroupMeta]) -> None:
        self.schema = schema
        self.groups = list(groups)
        self._stored_fields = _field_names(schema.stored_cls)
        self._removed_fields = _field_names(schema.removed_cls)
        # (group, hybridkv key) -> the vLLM key it was published under
        self._published: dict[tuple[int, bytes], ExternalHash] = {}
        # (group, vLLM key) -> cached blocks under it (announced while > 0)
        self._copies: dict[tuple[int, ExternalHash], int] = {}
        self._pending: list[Any] = []
        self.num_published = 0  # events handed out so far
        self.num_unpublished_blocks = 0

    # ------------------------------------------------------------------ input
    def record(self, events: Sequence[CacheEvent], request: Any | None) -> None:
        """Translate ``events`` (in order); ``request``: vLLM's request whose commit or
        release produced the stored ones (None: only removals expected)."""
        run: list[tuple[int, ExternalHash]] = []  # full blocks (end, key) of one group
        run_group = -1
        for event in events:
            if event.kind == BLOCK_REMOVED:
                self._flush(run, run_group, request)
                run = []
                self._removed(event)
                continue
            if request is None:
                raise InvariantError(
                    f"group {event.group_id}: a block ending at {event.num_tokens} tokens "
                    "was stored outside a request's commit or release; its vLLM key is "
                    "unknown"
                )
            meta = self.groups[event.group_id]
            end = event.num_tokens
            full = end % meta.block_size == 0
            # a full block that vLLM's coarser chain cannot name (its start is off the
            # unit): vLLM hashes coarser than a group's blocks only when a state group
            # is outside align mode, where no hit is possible anyway
            on_unit = meta.block_size % self.schema.hash_unit_tokens == 0
            key = self._vllm_key(request, end) if on_unit or not full else None
            if key is None:
                self.num_unpublished_blocks += 1
                continue
            if not self._announce(event, key):
                continue  # another cached block holds this vLLM key: announced already
            if full:
                contiguous = (
                    bool(run)
                    and run_group == event.group_id
                    and run[-1][0] + meta.block_size == end
                )
                if run and not contiguous:
                    self._flush(run, run_group, request)
                    run = []
                run.append((end, key))
                run_group = event.group_id
            else:
                self._flush(run, run_group, request)
                run = []
                self._stored_tail(request, event.group_id, end, key)
        self._flush(run, run_group, request)

    def clear(self) -> None:
        """vLLM's prefix cache was reset: every block is gone (``AllBlocksCleared``)."""
        self._published.clear()
        self._copies.clear()
        self._pending.append(self.schema.cleared_cls())

    def take(self) -> list[Any]:
        """The events translated since the last call, in order."""
        out, self._pending = self._pending, []
        self.num_published += len(out)
        return out

    # ------------------------------------------------------------------ keys
    def _chain(self, request: Any, end_tokens: int) -> bytes | None:
        """vLLM's chain hash of the request's first ``end_tokens`` tokens (None at 0)."""
        if end_tokens == 0:
            return None
        assert end_tokens % self.schema.hash_unit_tokens == 0, end_tokens
        hashes = request.block_hashes
        index = end_tokens // self.schema.hash_unit_tokens - 1
        if index >= len(hashes):
            raise InvariantError(
                f"request {request.request_id!r}: hybridkv cached a block ending at "
                f"{end_tokens} tokens, vLLM hashed {len(hashes)} units of "
                f"{self.schema.hash_unit_tokens}"
            )
        chain: bytes = hashes[index]
        return chain

    def _vllm_key(self, request: Any, end: int) -> ExternalHash:
        """The vLLM key of an entry ending at ``end``: the chain hash there when ``end``
        is on vLLM's unit, else vLLM's hash of the tail after the last unit (a turn-end
        entry; module docstring)."""
        unit = self.schema.hash_unit_tokens
        if end % unit == 0:
            chain = self._chain(request, end)
            assert chain is not None  # end > 0: hybridkv stores no empty block
            return self.schema.external_hash(chain)
        start = end // unit * unit
        tokens = request.all_token_ids[start:end]
        extra = self.schema.extra_keys(request, start, end)
        tail = self.schema.tail_hash(self._chain(request, start), tokens, extra)
        return self.schema.external_hash(tail)

    def _announce(self, event: CacheEvent, key: ExternalHash) -> bool:
        """Remember that hybridkv's block is published under ``key``; True if ``key``
        is new to the group (the event goes out)."""
        self._published[(event.group_id, event.block_hash)] = key
        count = self._copies.get((event.group_id, key), 0)
        self._copies[(event.group_id, key)] = count + 1
        return count == 0

    # ------------------------------------------------------------------ output
    def _flush(self, run: list[tuple[int, ExternalHash]], group: int, request: Any) -> None:
        """One ``BlockStored`` for consecutive full blocks of one group."""
        if not run:
            return
        size = self.groups[group].block_size
        start, end = run[0][0] - size, run[-1][0]
        extra = [self.schema.extra_keys(request, s, s + size) for s in range(start, end, size)]
        parent = self._chain(request, start)
        self._stored(request, group, [k for _, k in run], parent, start, end, size, extra)

    def _stored_tail(self, request: Any, group: int, end: int, key: ExternalHash) -> None:
        """One ``BlockStored`` for a partial entry: the tokens after the last vLLM unit
        below ``end`` (one whole unit when ``end`` is on a unit, as vLLM's own)."""
        unit = self.schema.hash_unit_tokens
        start = (end - 1) // unit * unit
        extra = [self.schema.extra_keys(request, start, end)]
        parent = self._chain(request, start)
        self._stored(request, group, [key], parent, start, end, end - start, extra)

    def _stored(
        self,
        request: Any,
        group: int,
        keys: list[ExternalHash],
        parent: bytes | None,
        start: int,
        end: int,
        block_size: int,
        extra: list[Any],
    ) -> None:
        meta = self.groups[group]
        lora = getattr(request, "lora_request", None)
        fields: dict[str, Any] = {
            "block_hashes": keys,
            "parent_block_hash": None if parent is None else self.schema.external_hash(parent),
            "token_ids": list(request.all_token_ids[start:end]),
            "block_size": block_size,
            "lora_id": None if lora is None else getattr(lora, "adapter_id", lora.lora_int_id),
            "medium": self.schema.medium,
            "lora_name": None if lora is None else lora.name,
            "extra_keys": self.schema.event_extra_keys(extra),
            "group_idx": group,
            "kv_cache_spec_kind": meta.spec_kind,
            "kv_cache_spec_sliding_window": meta.sliding_window,
            "session_id": getattr(request, "session_id", None),
        }
        if len(fields["token_ids"]) != len(keys) * block_size:
            raise InvariantError(
                f"group {group}: a stored event over tokens [{start}, {end}) holds "
                f"{len(keys)} blocks of {block_size}"
            )
        self._pending.append(
            self.schema.stored_cls(**{k: v for k, v in fields.items() if k in self._stored_fields})
        )

    def _removed(self, event: CacheEvent) -> None:
        key = self._published.pop((event.group_id, event.block_hash), None)
        if key is None:
            return  # never published (not on vLLM's unit, or stored before a reset)
        count = self._copies[(event.group_id, key)] - 1
        if count:
            self._copies[(event.group_id, key)] = count
            return
        del self._copies[(event.group_id, key)]
        last = self._pending[-1] if self._pending else None
        if (
            isinstance(last, self.schema.removed_cls)
            and getattr(last, "group_idx", None) == event.group_id
        ):
            last.block_hashes.append(key)  # consecutive removals of a group: one event
            return
        fields = {"block_hashes": [key], "medium": self.schema.medium, "group_idx": event.group_id}
        self._pending.append(
            self.schema.removed_cls(
                **{k: v for k, v in fields.items() if k in self._removed_fields}
            )
        )

    def check_invariants(self) -> None:
        """Every remembered block counts once under its published key."""
        counts: dict[tuple[int, ExternalHash], int] = {}
        for (group, _), key in self._published.items():
            counts[(group, key)] = counts.get((group, key), 0) + 1
        if counts != self._copies:
            raise InvariantError(
                f"event log: {len(self._published)} published blocks under "
                f"{len(counts)} keys, {len(self._copies)} keys counted"
            )


def vllm_event_log(
    scheduler: Any, kv_cache_config: Any, groups: Sequence[VllmGroup]
) -> VllmEventLog | None:
    """The event log for vLLM's ``scheduler`` when vLLM was asked for KV events
    (``--kv-events-config``) and prefix caching is on (nothing is stored otherwise);
    None otherwise, so an engine without events pays nothing. vLLM's scheduler
    publishes what `VllmEventLog.take` returns, stamped with its data-parallel rank."""
    if not getattr(scheduler, "enable_kv_cache_events", False):
        return None
    if not scheduler.cache_config.enable_prefix_caching:
        return None
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)

    def tail_hash(parent: bytes | None, tokens: Sequence[int], extra: Any) -> bytes:
        # vLLM reads its root hash (NONE_HASH) at call time: set by its engine core
        return bytes(kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens, extra))

    def extra_keys(request: Any, start: int, end: int) -> Any:
        return kv_cache_utils.generate_block_hash_extra_keys(request, start, end, 0)[0]

    schema = EventSchema(
        stored_cls=BlockStored,
        removed_cls=BlockRemoved,
        cleared_cls=AllBlocksCleared,
        hash_unit_tokens=int(scheduler.hash_block_size),
        external_hash=kv_cache_utils.maybe_convert_block_hash,
        tail_hash=tail_hash,
        extra_keys=extra_keys,
        event_extra_keys=kv_cache_utils.to_event_extra_keys,
    )
    metas = [
        GroupMeta(
            block_size=group.block_size,  # the manager's: equal to vLLM's (`kv_plan`)
            spec_kind=get_kv_cache_spec_kind(spec.kv_cache_spec).value,
            sliding_window=get_kv_cache_spec_sliding_window(spec.kv_cache_spec),
        )
        for group, spec in zip(groups, kv_cache_config.kv_cache_groups, strict=True)
    ]
    return VllmEventLog(schema, metas)
