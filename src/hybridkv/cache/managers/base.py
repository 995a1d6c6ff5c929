"""What every group manager provides; the coordinator talks to groups only through this.

A manager is stateless per request: each request's per-group state (a block table, or a
set of state blocks) is an object the manager creates and the request keeps. Positions:
``c`` = tokens computed before the step, ``n`` = verified tokens computed this step,
``L`` = lookahead slots (drafts), ``a`` = accepted drafts, ``c2 = c + n + a``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, NamedTuple

from hybridkv.cache.block_pool import BlockPool
from hybridkv.cache.delta import GroupDelta
from hybridkv.cache.rules import CacheRules
from hybridkv.errors import CacheError
from hybridkv.ids import BlockId
from hybridkv.plan.types import GroupPlan


@dataclass(frozen=True)
class StepSlots:
    """Which blocks of a state group the engine uses in the step just allocated (the
    cache's per-group view; the engine's batched tensor of slots is
    `hybridkv.engine.ops.context.StateSlots`).

    Read the initial state from ``read_block`` (None: start from zeros -- never from a
    block's old contents), write the state after ``write_num_tokens`` tokens into
    ``write_block`` (may equal ``read_block``: in place), the state after draft ``i + 1``
    into ``spec_blocks[i]``, and for each ``(num_tokens, block)`` of ``checkpoints`` the
    state after exactly ``num_tokens`` tokens into that block (ascending positions).
    ``checkpoint`` is the last of them (or None), for callers that take one.
    """

    num_computed_tokens: int
    read_block: BlockId | None
    write_block: BlockId
    write_num_tokens: int
    spec_blocks: tuple[BlockId, ...]
    checkpoints: tuple[tuple[int, BlockId], ...] = ()
    # worker-column layout only (`managers.state_columns`): the request's whole row of
    # block ids by column, and whole-block copies (source, destination) before the step
    columns: tuple[BlockId, ...] = ()
    copies: tuple[tuple[BlockId, BlockId], ...] = ()

    @property
    def checkpoint(self) -> tuple[int, BlockId] | None:
        return self.checkpoints[-1] if self.checkpoints else None


class FastLimits(NamedTuple):
    """How far a request's step may go in one group without this group's slow path.

    ``None`` means this group sets no bound of that kind. With ``c`` computed, ``n``
    new and ``L`` lookahead tokens, and ``c2 = c + n + a`` after ``a`` accepted::

        allocate needs nothing here while  c + n + L <= end_tokens   (slots held)
                                           c + n     <= verified_tokens
                                           L         <= lookahead_tokens
        commit has nothing to cache or release here while  c2 < commit_below

    Example, full attention B 16 holding 3 blocks, 2 cached: ``end_tokens 48,
    commit_below 48`` (the third block fills at 48 and is then cached).
    An immutable named tuple: built on every slow step, so it must be cheap.
    """

    end_tokens: int | None = None
    verified_tokens: int | None = None
    lookahead_tokens: int | None = None
    commit_below: int | None = None


NO_GROWTH: tuple[None, tuple[BlockId, ...]] = (None, ())

# "No bound" in `GroupManager.fast_bounds` (a `FastLimits` field of None), 2^62 - 1
# (docs/compiled_core.md). A step reaching it (no request holds 2^62 tokens) only
# misses the fast path: the slow path checks it.
UNBOUNDED: Final = (1 << 62) - 1
Bounds = tuple[int, int, int, int]  # `FastLimits` as ints, None -> UNBOUNDED


class Counters:
    """Mutable statistics shared by the managers and the facade."""

    def __init__(self) -> None:
        self.checkpoints_stored = 0
        self.checkpoints_used = 0


class GroupManager:
    """Base class; subclasses implement one group kind (see the table in ``__init__``).

    A manager owns its fast path: `fast_limits` says how far a step may go without
    its slow path, and `settle_fast` is what a commit within those limits does to the
    per-request state (nothing for attention; a slot swap for state groups, listed
    in ``moves_on_fast_commit``).
    """

    is_state: ClassVar[bool] = False  # slots per request instead of a token-indexed table
    releases: ClassVar[bool] = False  # releases blocks that leave its window
    moves_on_fast_commit: ClassVar[bool] = False  # settle_fast changes the state

    def __init__(
        self,
        group: GroupPlan,
        pool: BlockPool,
        *,
        unit_tokens: int,
        rules: CacheRules,
        counters: Counters,
        key_ahead: bool = False,
    ) -> None:
        self.group = group
        self.group_id = group.group_id
        self.block_size = group.block_size
        self.pool = pool
        self.unit_tokens = unit_tokens
        self.caching = rules.prefix_caching
        self.counters = counters
        self.index = pool.index[group.group_id]  # hash -> cached block of this group
        self.ghosts = pool.ghosts  # chain policy: recently evicted keys (else None)
        # EAGLE / MTP head layers: the head's KV at position p is computed from token
        # p + 1, so a block of a group holding head layers is keyed by its chain hash
        # *and* the token after it ("hash one token ahead"): a hit never reuses head KV
        # computed for another next token, and no block has to be dropped.
        self.key_ahead = key_ahead
        self.junction_rule = rules.junction  # read by state groups (`managers.state`)
        self.turn_end = rules.turn_end  # turn_end rule (`cache.turn_end`)
        # state groups: False checkpoints only where a step ends
        self.inside_steps = rules.checkpoints_inside_steps
        # lookahead every step reserves for the drafter's own KV (vLLM's
        # ``num_lookahead_tokens``: K for draft models, EAGLE, MTP), on top of the drafts
        # being verified; attention groups reserve it, state groups ignore it
        self.drafter_lookahead_tokens = rules.drafter_lookahead_tokens
        assert group.block_size % unit_tokens == 0
        self.init_kind()

    def init_kind(self) -> None:
        """A kind's own attributes, set once the common ones are."""

    # -- hashing helpers -----------------------------------------------------------
    def key(self, hashes: Sequence[bytes], tokens: Sequence[int], end_tokens: int) -> bytes:
        """Index key of the block ending at ``end_tokens`` (a multiple of the unit): the
        chain hash, plus token ``end_tokens`` when keyed ahead (the caller checks that
        this token is verified)."""
        chain = hashes[end_tokens // self.unit_tokens - 1]
        if self.key_ahead:
            return chain + int(tokens[end_tokens]).to_bytes(8, "little", signed=True)
        return chain

    def cacheable_end(self, num_computed: int, num_verified: int) -> int:
        """Tokens whose blocks may be cached: computed ones, and for a group keyed ahead
        only those followed by a verified token."""
        return min(num_computed, num_verified - 1) if self.key_ahead else num_computed

    def cached_block(
        self, hashes: Sequence[bytes], tokens: Sequence[int], end_tokens: int
    ) -> BlockId | None:
        """The cached block of this group whose data ends at ``end_tokens``, if any.
        The key is a sha256 chain over the whole prefix and its extra keys, so equal
        keys mean equal prefixes (`hashing`); no token comparison is needed."""
        if end_tokens <= 0 or end_tokens // self.unit_tokens > len(hashes):
            return None
        if self.key_ahead and end_tokens >= len(tokens):
            return None  # the token after the block is not known yet
        key = hashes[end_tokens // self.unit_tokens - 1]
        if self.key_ahead:
            key += int(tokens[end_tokens]).to_bytes(8, "little", signed=True)
        block = self.index.get(key)
        if block is None and self.ghosts:
            self.pool.lookup(self.group_id, key)  # tells the eviction policy of the miss
        return block

    def try_cache(
        self, block: BlockId, hashes: Sequence[bytes], tokens: Sequence[int], end_tokens: int
    ) -> bool:
        if self.key_ahead and end_tokens >= len(tokens):
            return False  # the token after the block is not verified yet
        key = self.key(hashes, tokens, end_tokens)
        return self.pool.cache(block, self.group_id, key, end_tokens)

    # -- interface -----------------------------------------------------------------
    def new_state(self) -> Any:
        raise NotImplementedError

    def max_hit(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        limit: int,
        found: dict[int, BlockId],
    ) -> int:
        """Longest hit <= ``limit`` tokens this group can serve (0 always works); every
        cached block seen goes into ``found`` (end position -> block) for `hit_state`.
        Idempotent: ``max_hit(h) == h`` for the ``h`` it returns. ``hashes``: the
        request's chain hashes; ``root``: the chain's root, the hash at 0
        (`hashing.chain_hash_at`: what turn-end entries and junction children inside
        the first block hang off)."""
        raise NotImplementedError

    def hit_state(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        hit: int,
        found: dict[int, BlockId] | None,
    ) -> Any:
        """Per-request state holding the hit blocks (not yet touched), or None when one
        of them was evicted since the lookup. ``found``: blocks `max_hit` saw, valid
        only when nothing was evicted since (None: look them up again)."""
        raise NotImplementedError

    def num_new_blocks(self, state: Any, c: int, n: int, lookahead: int) -> int:
        raise NotImplementedError

    def allocate(self, state: Any, c: int, n: int, lookahead: int, num_new: int) -> list[BlockId]:
        """Take exactly ``num_new`` blocks (``== num_new_blocks(state, c, n, lookahead)``,
        which the caller computed to check the pool) and lay out the step."""
        return self.place(state, c, n, lookahead, self.pool.take_many(num_new) if num_new else [])

    def place(
        self, state: Any, c: int, n: int, lookahead: int, new: list[BlockId]
    ) -> list[BlockId]:
        """`allocate` with its ``num_new`` blocks already taken, in the order
        `BlockPool.take_many` hands them out (the coordinator takes every group's blocks
        of a step in one pool call); returns ``new``."""
        raise NotImplementedError

    def reserve_blocks(self, state: Any, start_max: int, n: int, lookahead: int) -> int:
        """Blocks a next step (``n`` new tokens, ``lookahead``) may need while the step
        before it is still pending: it starts where that step's accepted drafts end, at
        most at ``start_max`` (all accepted). An engine that schedules the next step
        before the accepted count is known (vLLM's async scheduling with drafts) holds
        them now; the next step's own `allocate`, after the commit, takes none."""
        raise CacheError(
            f"group {self.group_id} ({type(self).__name__}) cannot hold blocks for a step "
            "ahead of a pending one"
        )

    def reserve(
        self, state: Any, start_max: int, n: int, lookahead: int, new: list[BlockId]
    ) -> None:
        """Hold ``new`` (``reserve_blocks`` of them, already taken) for the step ahead,
        where the next `allocate` looks for them; nothing else of the state changes."""
        raise CacheError(f"group {self.group_id} cannot hold blocks for a step ahead")

    def grow(
        self, state: Any, c: int, n: int, lookahead: int
    ) -> tuple[GroupDelta | None, tuple[BlockId, ...]] | None:
        """A running request's step that only this group's limits refuse: take what
        `num_new_blocks` says and lay out the step; returns (this group's delta or None,
        the blocks taken), or None with nothing changed when the pool is short."""
        count = self.num_new_blocks(state, c, n, lookahead)
        if count and count > len(self.pool.free):
            return None
        if not count and not self.is_state:
            return NO_GROWTH  # a table that needs no block: nothing to lay out
        new = self.allocate(state, c, n, lookahead, count)
        if not new:
            return NO_GROWTH
        return self.delta(state, new, False), tuple(new)

    def commit(
        self,
        state: Any,
        c: int,
        n: int,
        lookahead: int,
        accepted: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
    ) -> tuple[int, int] | None:
        """Settle a step: cache what became verified, release what is no longer needed.
        Returns the table positions ``[lo, hi)`` that became the null block, if any."""
        raise NotImplementedError

    def settle_fast(self, state: Any, accepted: int) -> None:
        """Settle a step that stayed within `fast_limits` (``c2 < commit_below``)."""

    def settle_fast_all(self, states: list[Any], accepted: int) -> None:
        """`settle_fast` for the states of several groups of this kind at once (one
        call per request and kind on the fast path; the states may be other groups'
        of this kind, so the rule must read nothing of ``self``'s own group)."""

    def delta(self, state: Any, new_blocks: Sequence[BlockId], whole: bool) -> GroupDelta | None:
        """What an engine's persistent table of this group must apply after `allocate`
        took ``new_blocks`` (``whole``: the request was just admitted). None: nothing
        (state groups hand out slots, see `StateManager.slots`)."""
        return None

    def release_all(self, state: Any) -> None:
        self.pool.release_many(self.detach(state))

    def detach(self, state: Any) -> list[BlockId]:
        """Empty ``state`` and return every block `release_all` releases, in its order
        (the caller releases them: a request's groups in one pool call, under lru)."""
        raise NotImplementedError

    def turn_end_tokens(self, state: Any, c: int) -> int:
        """How many of a request's ``c`` settled tokens this group can keep a turn end at
        (`keep_turn_end`): ``c``, unless its data for the last tokens is split (vLLM's
        worker columns after accepted drafts); 0: none. Every group keeps its turn end at
        the least of these, so a later hit finds all groups there."""
        return c

    def keep_turn_end(
        self, state: Any, c: int, hashes: Sequence[bytes], root: bytes, tokens: Sequence[int]
    ) -> None:
        """turn_end rule, just before `release_all` of a request settled at ``c``
        computed tokens: cache what holds the data at ``c`` (see `cache.turn_end`)."""

    def adopt(self, state: Any) -> None:
        """After an admission touched the hit blocks: take over the turn-end blocks the
        request will write (`BlockPool.uncache`)."""

    def copy_order(self, state: Any) -> tuple[BlockId, BlockId, int] | None:
        """(source, destination, slots) of the junction copy an admission allocated
        (`cache.junction`); None for groups that copy nothing."""
        return None

    def held(self, state: Any) -> list[BlockId]:
        """Every non-null block the request references in this group (with repeats)."""
        raise NotImplementedError

    def fast_limits(self, state: Any, c: int) -> FastLimits:
        """This group's bounds on the fast path for ``state`` at ``c`` computed tokens."""
        return FastLimits(*(None if x == UNBOUNDED else x for x in self.fast_bounds(state, c)))

    def fast_bounds(self, state: Any, c: int) -> Bounds:
        """`fast_limits` as a plain tuple of ints (``UNBOUNDED`` for None): what the
        request record caches after every slow step (no named tuple, no None tests)."""
        raise NotImplementedError

    def slots(self, state: Any, c: int, n: int, lookahead: int) -> StepSlots:
        """The blocks a state group reads and writes in the allocated step."""
        raise CacheError(f"group {self.group_id} is {self.group.kind}, not a state group")

    def check_state(self, state: Any, c: int) -> None:
        """Raise InvariantError if the per-request state is inconsistent."""
