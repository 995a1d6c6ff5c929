"""State layers (Mamba, Gated DeltaNet, short conv, ...): one state per request, no
per-token pages. ``block_size`` is the checkpoint interval ``B`` in ``align`` mode.

Blocks a request holds in a state group (S = ``num_spec_states``)::

    running   state after exactly c = num_computed tokens (None while c == 0: zeros)
    write     where this step's state after c + n tokens goes: the running block itself
              (updated in place) unless that block is a cached checkpoint, which is never
              written -> then a private block
    spec[i]   state after draft i + 1, i.e. after c + n + i + 1 tokens (i < min(L, S))
    ckpt      align only: the state after the last boundary strictly inside (c, c + n),
              when the budget of 2 + S blocks leaves room for it

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

from hybridkv.cache.managers.base import FastLimits, GroupManager, StepSlots
from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId


@dataclass
class StateBlocks:
    """A request's blocks in one state group (see the module docstring)."""

    running: BlockId | None = None
    write: BlockId | None = None
    spares: list[BlockId] = field(default_factory=list)  # spec slots are spares[:min(L, S)]
    ckpt_pos: int = 0
    ckpt_block: BlockId | None = None


# Older name of `StepSlots`, kept for callers outside the package.
StateSlots = StepSlots


class StateManager(GroupManager):
    is_state = True
    moves_on_fast_commit = True

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.num_spec_states = self.group.num_spec_states
        self.align = self.group.state_mode == "align"
        self.checkpoints = self.align and self.caching
        # The spec's formula at its largest (a step reading a cached checkpoint):
        # 2 + S in align mode, 1 + S in none mode.
        self.budget_blocks = self.group.blocks_at(self.block_size, 1, self.num_spec_states)

    def new_state(self) -> StateBlocks:
        return StateBlocks()

    def max_hit(
        self,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        limit: int,
        eagle: bool,
        found: dict[int, BlockId],
    ) -> int:
        # The state after L tokens does not depend on later tokens, so EAGLE needs no
        # extra block here: the attention groups' dropped block already moves the hit
        # strictly before the end of the cached chain.
        if not self.checkpoints:
            return 0
        B = self.block_size
        pos = min(limit, len(hashes) * self.unit_tokens) // B * B
        while pos > 0:
            block = found.get(pos)
            if block is None:
                block = self.cached_block(hashes, tokens, pos)
            if block is not None:
                found[pos] = block
                return pos
            pos -= B
        return 0

    def hit_state(
        self,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        hit: int,
        found: dict[int, BlockId] | None,
    ) -> StateBlocks | None:
        if hit == 0:
            return StateBlocks()
        block = found.get(hit) if found is not None else None
        if block is None:
            block = self.cached_block(hashes, tokens, hit)
        return None if block is None else StateBlocks(running=block)

    def _running_private(self, state: StateBlocks) -> bool:
        return state.running is not None and not self.pool.is_cached(state.running)

    def _layout(self, state: StateBlocks, c: int, n: int, lookahead: int) -> tuple[int, int, int]:
        """(needs a write block, spec slots, checkpoint position or 0)."""
        need_write = 0 if self._running_private(state) else 1
        num_spec = min(lookahead, self.num_spec_states)
        ckpt_pos = 0
        if self.checkpoints and n > 0:
            boundary = (c + n - 1) // self.block_size * self.block_size
            held = (state.running is not None) + max(len(state.spares), need_write + num_spec + 1)
            if boundary > c and held <= self.budget_blocks:
                ckpt_pos = boundary
        return need_write, num_spec, ckpt_pos

    def num_new_blocks(self, state: StateBlocks, c: int, n: int, lookahead: int) -> int:
        need_write, num_spec, ckpt_pos = self._layout(state, c, n, lookahead)
        return max(0, need_write + num_spec + (ckpt_pos > 0) - len(state.spares))

    def allocate(
        self, state: StateBlocks, c: int, n: int, lookahead: int, num_new: int
    ) -> list[BlockId]:
        need_write, _, ckpt_pos = self._layout(state, c, n, lookahead)
        take = self.pool.take
        new = [take() for _ in range(num_new)]
        state.spares.extend(new)
        state.write = state.spares.pop(0) if need_write else state.running
        if ckpt_pos:
            state.ckpt_pos, state.ckpt_block = ckpt_pos, state.spares.pop()
        return new

    def commit(
        self,
        state: StateBlocks,
        c: int,
        n: int,
        lookahead: int,
        accepted: int,
        hashes: Sequence[bytes],
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
        produced: list[tuple[int, BlockId]] = [(c + n, state.write)]
        produced += [(c + n + 1 + i, state.spares[i]) for i in range(num_spec)]
        if state.ckpt_block is not None:
            produced.append((state.ckpt_pos, state.ckpt_block))
        new_running = produced[accepted][1]
        spares: list[BlockId] = []
        for pos, block in produced:
            if block == new_running:
                continue
            if pos <= c2 and self._store_checkpoint(block, pos, hashes, tokens):
                self.pool.release(block)  # stays in the cache as evictable
            else:
                spares.append(block)
        old = state.running
        if old is not None and old != state.write:
            self.pool.release(old)  # a read-only checkpoint this step started from
        self._store_checkpoint(new_running, c2, hashes, tokens)
        state.running = new_running
        state.write = new_running if not self.pool.is_cached(new_running) else None
        state.spares = spares + state.spares[num_spec:]
        state.ckpt_pos, state.ckpt_block = 0, None
        return None

    def settle_fast(self, state: StateBlocks, accepted: int) -> None:
        """The step wrote in place and produced no checkpoint: the state after the last
        accepted draft (spec slot ``a - 1``) becomes the running block, and the old
        running block takes that slot's place, so spare order is kept::

            running r, spares [s0, s1, s2], a = 2  ->  running s1, spares [s0, r, s2]
        """
        self.settle_fast_all((state,), accepted)

    @classmethod
    def settle_fast_all(cls, states: Sequence[StateBlocks], accepted: int) -> None:
        if accepted:
            i = accepted - 1
            for state in states:
                spares = state.spares
                block = spares[i]
                spares[i] = state.running  # type: ignore[assignment]  # set: c > 0
                state.running = state.write = block

    def _settles_in_place(self, state: StateBlocks, c: int, n: int, c2: int) -> bool:
        """True when the step wrote in place and no state it produced at or before ``c2``
        (positions c + n .. c2) sits on a checkpoint boundary: nothing is cached or
        released, and the general path below reduces to moving one spec slot."""
        if state.write != state.running or state.ckpt_block is not None:
            return False
        if not self.checkpoints:
            return True
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
            checkpoint=None if state.ckpt_block is None else (state.ckpt_pos, state.ckpt_block),
        )

    def _store_checkpoint(
        self, block: BlockId, pos: int, hashes: Sequence[bytes], tokens: Sequence[int]
    ) -> bool:
        if not self.checkpoints or pos <= 0 or pos % self.block_size:
            return False
        if not self.try_cache(block, hashes, tokens, pos):
            return False
        self.counters.checkpoints_stored += 1
        return True

    def release_all(self, state: StateBlocks) -> None:
        self.pool.release_many(self.held(state)[::-1])
        state.running = state.write = state.ckpt_block = None
        state.spares = []
        state.ckpt_pos = 0

    def held(self, state: StateBlocks) -> list[BlockId]:
        out = [] if state.running is None else [state.running]
        if state.write is not None and state.write != state.running:
            out.append(state.write)
        out += state.spares
        if state.ckpt_block is not None:
            out.append(state.ckpt_block)
        return out

    def fast_limits(self, state: StateBlocks, c: int) -> FastLimits:
        # Allocate: a private running block is written in place (any n), a cached one
        # (or none yet) needs a write block for any step past c; drafts need spares;
        # a step reaching the next boundary may need a checkpoint block.
        # Commit: `settle_fast` only swaps running and a spec slot, so the step must
        # have written in place, and stop before the boundary (which gets cached).
        boundary = (c // self.block_size + 1) * self.block_size if self.checkpoints else None
        spares = len(state.spares)
        in_place = state.write == state.running and state.ckpt_block is None
        return FastLimits(  # positional (cheaper): end, verified, lookahead, commit_below
            None if self._running_private(state) else c,
            boundary,
            None if spares >= self.num_spec_states else spares,
            (boundary if in_place else c) if c > 0 else 0,
        )

    def check_state(self, state: StateBlocks, c: int) -> None:
        held = self.held(state)
        if len(held) != len(set(held)):
            raise InvariantError(f"group {self.group_id}: a state block is held twice {held}")
        if len(held) > self.budget_blocks:
            raise InvariantError(
                f"group {self.group_id}: {len(held)} state blocks held, budget {self.budget_blocks}"
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
