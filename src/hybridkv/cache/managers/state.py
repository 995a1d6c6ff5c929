"""State layers (Mamba, Gated DeltaNet, short conv, ...): one state per request, no
per-token pages. ``block_size`` is the checkpoint interval ``B`` (modes ``align`` and
``all``).

Checkpoint modes (the group's ``state_mode``):

* ``none``: no checkpoints; a state group never serves a hit.
* ``align``: the state after the last boundary strictly inside a step (when the budget
  of 2 + S blocks leaves room), the state at the end of a step that ends on a boundary,
  and boundaries reached while decoding. A prefill chunk that spans several boundaries
  keeps only its last one, so hits land where chunks ended.
* ``all``: a checkpoint at every boundary inside every step: the engine writes the
  state at each boundary of a chunk (``StateSlots.checkpoints``). The extra blocks are
  transient: each is cached (or, as a duplicate, freed) when the step commits.

Extra rule ``junction`` (any caching mode): when a request's prompt matches the cache
further than its state hit (attention blocks cached to J, state only to a checkpoint
before J), the step that crosses the boundary at or below J also checkpoints there,
so the next request sharing that prefix finds a state where the shared prefix ends.
With the ``turn_end`` rule too, that checkpoint is at J itself (an attention block
boundary or, with junction copies, any point inside a block: `cache.junction`), cached
under a turn-end key (`cache.turn_end`).

Blocks a request holds in a state group (S = ``num_spec_states``)::

    running   state after exactly c = num_computed tokens (None while c == 0: zeros)
    write     where this step's state after c + n tokens goes: the running block itself
              (updated in place) unless that block is a cached checkpoint, which is never
              written -> then a private block
    spec[i]   state after draft i + 1, i.e. after c + n + i + 1 tokens (i < min(L, S))
              (slots are sticky: the first step whose drafts need more takes all S)
    ckpts     (position, block) pairs: the state after boundaries strictly inside
              (c, c + n): align keeps the last one when the budget of 2 + S blocks
              leaves room, all keeps every one, junction adds its boundary

One decode step, B = 8, c = 14, n = 1, L = 3 (drafts at 15, 16, 17)::

    tokens      ... 13 | 14 | 15  16  17
    read        running (after 14)
    write              after 15
    spec[0..2]              after 16 (boundary 16!), 17, 18

    accepted a = 0 -> running = write  (spec[0] held a rejected draft: never cached)
    accepted a = 2 -> running = spec[1]; spec[0] (after 16, every token accepted) is
                      cached under the chain hash at 16 and released to the cache;
                      write becomes a spare

A prefill chunk c = 0, n = 20 (B = 8): read None (zeros), ckpt = (16, block), write gets
the state after 20. After commit the checkpoint at 16 is cached. A chunk ending exactly
on a boundary caches its write block, which then becomes a read-only running block.

Checkpoints enter the cache only at commit and only at positions <= c2 = c + n + a:
every covered token is accepted. ``none`` mode never caches, so its hit is always 0.
A hit at a checkpoint makes that cached block the running block (read only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from hybridkv.cache.managers.base import UNBOUNDED, Bounds, GroupManager, StepSlots
from hybridkv.cache.turn_end import find_turn_end, store_turn_end
from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId


@dataclass
class StateBlocks:
    """A request's blocks in one state group (see the module docstring)."""

    running: BlockId | None = None
    write: BlockId | None = None
    spares: list[BlockId] = field(default_factory=list)  # spec slots are spares[:min(L, S)]
    ckpts: list[tuple[int, BlockId]] = field(default_factory=list)  # this step's checkpoints
    junction: int = 0  # junction rule: a boundary to checkpoint when a step crosses it


# Older name of `StepSlots`, kept for callers outside the package.
StateSlots = StepSlots


class StateManager(GroupManager):
    is_state = True
    moves_on_fast_commit = True

    def init_kind(self) -> None:
        self.num_spec_states = self.group.num_spec_states
        self.every_boundary = self.group.state_mode == "all"
        self.checkpoints = self.group.state_mode in ("align", "all") and self.caching
        # The spec's formula at its largest between steps (a step reading a cached
        # checkpoint): 2 + S in align and all modes, 1 + S in none mode. Checkpoints of
        # the step in flight come on top (all mode, junction rule; see `blocks_needed`).
        self.budget_blocks = self.group.blocks_at(self.block_size, 1, self.num_spec_states)
        # the last `num_new_blocks` call: (state, c, n, lookahead, its layout)
        self._memo: tuple[StateBlocks, int, int, int, tuple[int, int, list[int]]] | None = None

    def new_state(self) -> StateBlocks:
        return StateBlocks()

    def max_hit(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        limit: int,
        found: dict[int, BlockId],
    ) -> int:
        if not self.checkpoints:
            return 0
        B = self.block_size
        pos = min(limit, len(hashes) * self.unit_tokens) // B * B
        turn_end = self.turn_end
        while True:
            if turn_end and pos < limit:  # a turn end in (pos, limit] beats pos
                entry = find_turn_end(self, hashes, root, tokens, pos, limit)
                if entry is not None:
                    found[entry[0]] = entry[1]
                    return entry[0]
            if pos <= 0:
                return 0
            block = found.get(pos)
            if block is None:
                block = self.cached_block(hashes, tokens, pos)
            if block is not None:
                found[pos] = block
                return pos
            pos -= B

    def hit_state(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        hit: int,
        found: dict[int, BlockId] | None,
    ) -> StateBlocks | None:
        if hit == 0:
            return StateBlocks()
        block = found.get(hit) if found is not None else None
        if block is None:
            B = self.block_size
            if hit % B:
                entry = find_turn_end(self, hashes, root, tokens, hit // B * B, hit, exact=True)
                block = None if entry is None else entry[1]
            else:
                block = self.cached_block(hashes, tokens, hit)
        return None if block is None else StateBlocks(running=block)

    def keep_turn_end(
        self,
        state: StateBlocks,
        c: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
    ) -> None:
        # The running block holds the state after exactly c tokens once a step settled;
        # a checkpoint boundary is cached at commit already.
        running = state.running
        if (
            not self.checkpoints
            or running is None
            or self.cacheable_end(c, len(tokens)) != c
            or self.pool.is_cached(running)
        ):
            return
        if store_turn_end(self, running, hashes, root, tokens, c):
            self.counters.checkpoints_stored += 1
            # released now, first to evict (`cache.turn_end`); release_all skips it
            self.pool.release(running, dead=True)
            if state.write == running:
                state.write = None
            state.running = None

    def _running_private(self, state: StateBlocks) -> bool:
        return state.running is not None and not self.pool.is_cached(state.running)

    def _layout(
        self, state: StateBlocks, c: int, n: int, lookahead: int
    ) -> tuple[int, int, list[int]]:
        """(needs a write block, spec slots, checkpoint positions, ascending)."""
        running = state.running
        need_write = 0 if running is not None and running not in self.pool.hashes else 1
        num_spec = min(lookahead, self.num_spec_states)
        positions: list[int] = []
        if self.checkpoints and n > 0 and self.inside_steps:
            B = self.block_size
            last = (c + n - 1) // B * B  # the last boundary strictly inside (c, c + n)
            if last > c:
                if self.every_boundary:
                    positions = list(range((c // B + 1) * B, last + 1, B))
                else:
                    held = (state.running is not None) + max(
                        len(state.spares), need_write + num_spec + 1
                    )
                    if held <= self.budget_blocks:
                        positions = [last]
            # (inside an interval, under turn_end, a step may cross it and no boundary)
            j = state.junction
            if self.junction_rule and c < j < c + n and j not in positions:
                positions = sorted([*positions, j])
        return need_write, num_spec, positions

    def num_new_blocks(self, state: StateBlocks, c: int, n: int, lookahead: int) -> int:
        layout = self._layout(state, c, n, lookahead)
        # `allocate` follows for the same step when the pool has room: it reuses this
        # layout (nothing between the two calls can change it: the running block is
        # referenced, so no eviction uncaches it)
        self._memo = (state, c, n, lookahead, layout)
        need_write, num_spec, positions = layout
        new = need_write + num_spec + len(positions) - len(state.spares)
        if new <= 0:
            return 0
        if num_spec:
            # Sticky spares: a step whose drafts need more slots than held takes all S
            # at once (as many as the budget leaves), so a request grows its spec slots
            # once instead of at every new largest draft count. The spec's formula
            # (`StateSpec.blocks_needed`: 1 + S, kept once taken) and the
            # planner already count S slots per request; spares only shrink on free,
            # preempt, or when a checkpoint caches one.
            room = self.budget_blocks - (state.running is not None) - need_write
            spec_slots = max(num_spec, min(self.num_spec_states, room))
            new = need_write + spec_slots + len(positions) - len(state.spares)
        return new

    def place(
        self, state: StateBlocks, c: int, n: int, lookahead: int, new: list[BlockId]
    ) -> list[BlockId]:
        memo, self._memo = self._memo, None
        if memo is not None and memo[0] is state and memo[1:4] == (c, n, lookahead):
            need_write, _, positions = memo[4]
        else:
            need_write, _, positions = self._layout(state, c, n, lookahead)
        state.spares.extend(new)
        state.write = state.spares.pop(0) if need_write else state.running
        state.ckpts = [(pos, state.spares.pop()) for pos in positions]
        return new

    def commit(
        self,
        state: StateBlocks,
        c: int,
        n: int,
        lookahead: int,
        accepted: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
    ) -> tuple[int, int] | None:
        c2 = c + n + accepted
        num_spec = min(lookahead, self.num_spec_states)
        assert accepted <= num_spec
        if state.write is None:  # an empty step over a cached checkpoint: nothing written
            assert n == 0 and accepted == 0
            return None
        if self._settles_in_place(state, c, n, c2):
            self.settle_fast(state, accepted)
            return None
        write, old_spares = state.write, state.spares
        produced: list[tuple[int, BlockId]] = [(c + n, write)]
        first = c + n + 1  # S spares once drafted
        produced += [(first + k, old_spares[k]) for k in range(num_spec)]
        produced += state.ckpts
        new_running = produced[accepted][1]
        spares: list[BlockId] = []
        junction = state.junction if self.turn_end else 0
        B = self.block_size
        for pos, block in produced:
            if block == new_running:
                continue
            # only a boundary (or the junction) is stored: skip the call for the others
            if (
                pos <= c2
                and (not pos % B or pos == junction)
                and self._store_checkpoint(block, pos, hashes, root, tokens, pos == junction)
            ):
                self.pool.release(block)  # stays in the cache as evictable
            else:
                spares.append(block)
        old = state.running
        if old is not None and old != write:
            self.pool.release(old)  # a read-only checkpoint this step started from
        if not c2 % B or c2 == junction:
            self._store_checkpoint(new_running, c2, hashes, root, tokens, c2 == junction)
        state.running = new_running
        state.write = None if new_running in self.pool.hashes else new_running
        spares += old_spares[num_spec:]
        state.spares = spares
        state.ckpts = []
        if state.junction and c2 >= state.junction:
            state.junction = 0
        # duplicates of cached checkpoints come back as spares: keep only the budget
        # (`held` is now the running block and the spares)
        excess = 1 + len(spares) - self.budget_blocks
        while spares and excess > 0:
            self.pool.release(spares.pop())
            excess -= 1
        return None

    def settle_fast(self, state: StateBlocks, accepted: int) -> None:
        """The step wrote in place and produced no checkpoint: the state after the last
        accepted draft (spec slot ``a - 1``) becomes the running block, and the old
        running block takes that slot's place, so spare order is kept::

            running r, spares [s0, s1, s2], a = 2  ->  running s1, spares [s0, r, s2]
        """
        self.settle_fast_all([state], accepted)

    def settle_fast_all(self, states: list[StateBlocks], accepted: int) -> None:
        # ``running`` is set here (c > 0)
        if accepted:
            i = accepted - 1
            for state in states:
                spares = cast("list[BlockId | None]", state.spares)
                block = spares[i]
                spares[i] = state.running
                state.running = state.write = block

    def _settles_in_place(self, state: StateBlocks, c: int, n: int, c2: int) -> bool:
        """True when the step wrote in place and no state it produced at or before ``c2``
        (positions c + n .. c2) sits on a checkpoint boundary: nothing is cached or
        released, and the general path below reduces to moving one spec slot."""
        if state.write != state.running or state.ckpts:
            return False
        if not self.checkpoints:
            return True
        if self.turn_end and c < state.junction <= c2:
            return False  # a junction inside the interval, reached: cache it
        B = self.block_size
        return c2 < (c // B + 1) * B and (n > 0 or c % B != 0)

    def slots(self, state: StateBlocks, c: int, n: int, lookahead: int) -> StepSlots:
        assert state.write is not None
        num_spec = min(lookahead, self.num_spec_states)
        return StepSlots(
            num_computed_tokens=c,
            read_block=state.running,
            write_block=state.write,
            write_num_tokens=c + n,
            spec_blocks=tuple(state.spares[:num_spec]),
            checkpoints=tuple(state.ckpts),
        )

    def _store_checkpoint(
        self,
        block: BlockId,
        pos: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        junction: bool = False,
    ) -> bool:
        """Cache the state after ``pos`` tokens held in ``block``: at a boundary, or
        (``junction``: the junction rule's checkpoint under turn_end) inside one."""
        if not self.checkpoints or pos <= 0:
            return False
        if pos % self.block_size:
            if not (junction and store_turn_end(self, block, hashes, root, tokens, pos)):
                return False
        elif not self.try_cache(block, hashes, tokens, pos):
            return False
        self.counters.checkpoints_stored += 1
        return True

    def detach(self, state: StateBlocks) -> list[BlockId]:
        out = self.held(state)[::-1]
        state.running = state.write = None
        state.spares = []
        state.ckpts = []
        state.junction = 0
        return out

    def held(self, state: StateBlocks) -> list[BlockId]:
        out = [] if state.running is None else [state.running]
        if state.write is not None and state.write != state.running:
            out.append(state.write)
        out += state.spares
        out += [block for _, block in state.ckpts]
        return out

    def fast_bounds(self, state: StateBlocks, c: int) -> Bounds:
        # Allocate: a private running block is written in place (any n), a cached one
        # (or none yet) needs a write block for any step past c; drafts need spares;
        # a step reaching the next boundary may need a checkpoint block.
        # Commit: `settle_fast` only swaps running and a spec slot, so the step must
        # have written in place, and stop before the boundary (which gets cached).
        # end, verified, lookahead, commit_below
        if self.checkpoints:
            boundary = (c // self.block_size + 1) * self.block_size
            if c < state.junction < boundary:
                boundary = state.junction  # turn_end: a junction inside the interval
        else:
            boundary = UNBOUNDED
        running = state.running
        spares = len(state.spares)
        return (
            UNBOUNDED if running is not None and running not in self.pool.hashes else c,
            boundary,
            UNBOUNDED if spares >= self.num_spec_states else spares,
            0 if not c else boundary if state.write == running and not state.ckpts else c,
        )

    def check_state(self, state: StateBlocks, c: int) -> None:
        held = self.held(state)
        if len(held) != len(set(held)):
            raise InvariantError(f"group {self.group_id}: a state block is held twice {held}")
        # checkpoints of the step in flight are transient: cached or freed at commit
        if len(held) - len(state.ckpts) > self.budget_blocks:
            raise InvariantError(
                f"group {self.group_id}: {len(held)} state blocks held ({len(state.ckpts)} "
                f"checkpoints in flight), budget {self.budget_blocks}"
            )
        positions = [pos for pos, _ in state.ckpts]
        inside = state.junction if self.turn_end else None  # may sit inside an interval
        if positions != sorted(set(positions)) or any(
            pos <= c or (pos % self.block_size and pos != inside) for pos in positions
        ):
            raise InvariantError(
                f"group {self.group_id}: checkpoint positions {positions} are not ascending "
                f"boundaries (interval {self.block_size}) after {c} computed tokens"
            )
        if (state.running is None) != (c == 0):
            raise InvariantError(
                f"group {self.group_id}: running state {state.running} at {c} computed tokens"
            )
        for block in held:
            if block != state.running and self.pool.is_cached(block):
                raise InvariantError(
                    f"group {self.group_id}: writable state block {block} is cached"
                )
