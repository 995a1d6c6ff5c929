"""State groups laid out as the positional rows of vLLM's workers (``state_layout``
``"columns"``), for speculative decoding on state layers inside vLLM.

hybridkv's own engine reads a state group through slots (`StepSlots`: read, write, one
block per draft), and `StateManager` moves those roles between blocks as drafts are
accepted. vLLM's workers instead read one append-only row of block ids per request and
give every column a fixed meaning (vllm/v1/worker/mamba_utils.py ``preprocess_mamba``
and ``postprocess_mamba_fused_kernel``; gdn_attn.py; vLLM 0.32 / 0.33). With ``B`` the
group's block size, ``K`` the speculative tokens, ``c`` computed and ``n + d`` scheduled
tokens (``d`` drafts)::

    column       0 .. cur-1                cur                  cur+1 .. cur+K
    holds        null, or the checkpoint   the state after c+n  the state after draft
                 after (col+1)*B tokens    (updated in place)   i, in column cur+i

    cur = ceil((c + n + d) / B) - 1

* A step starts from the state after ``c``: ssm part in column ``cur + a`` and conv
  window in column ``cur`` at offset ``a`` (``a`` drafts accepted by the previous step)
  while ``cur`` stays; when ``cur`` moves the worker first copies that state, joined,
  into the new column ``cur`` (the pre-copy).
* After acceptance, when the accepted tokens reach a boundary ``k*B``, the worker copies
  the state there, joined, into column ``k - 1`` (the post-copy): that block becomes
  the checkpoint hybridkv caches.
* So the state after exactly ``c2`` tokens sits in one block only when no draft was
  accepted; column ``cur`` always holds a whole state, after ``c + n`` (`whole_at`),
  which is where a turn-end entry is kept.

Worked example, B 4, K 2, a decode step from c = 6 with d = 2 (end 9, cur 2)::

    row before   [0, r1, s2, s3]       r1 running (cur 1), s2 s3 scratch
    this step    [0, r1, s2, s3, s4]   cur 2: s2 runs (pre-copy r1 -> s2), s3 s4 scratch;
                                       r1 is left behind (column 1 = boundary 8)
    accepted 2 -> c2 = 9: the post-copy writes the state after 8 into column 1 (r1),
                 which is cached as the checkpoint at 8 and released

Blocks the row no longer needs in its scratch range are moved to new columns (the same
id appended again, as vLLM's own manager does), so the worker reads every id only where
it last appeared. A request holds at most ``2 + K`` blocks (running, K scratch, the
column left behind), plus one hit block until its first step has copied it, or plus one
scratch column held for a step scheduled before the accepted count is known
(`reserve`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.cache.managers.base import Bounds, StepSlots
from hybridkv.cache.managers.state import StateBlocks, StateManager
from hybridkv.cache.turn_end import store_turn_end
from hybridkv.errors import InvariantError
from hybridkv.ids import BlockId

_NULL = BlockId(0)


@dataclass
class ColumnBlocks(StateBlocks):
    """A request's blocks in one state group, by worker column (see the module doc).

    ``running`` (inherited) is the hit block until the first step has read it."""

    row: list[BlockId] = field(default_factory=list)  # the worker's row, as handed out
    cols: dict[int, BlockId] = field(default_factory=dict)  # columns whose block we hold
    cur: int = -1  # the worker's running column after the last step (-1: none yet)
    left: int = -1  # the column the last move of ``cur`` left behind (-1: none)
    whole_at: int = -1  # tokens whose whole state column ``cur`` holds (-1: unknown)
    copies: list[tuple[BlockId, BlockId]] = field(default_factory=list)  # before the step
    drop: list[BlockId] = field(default_factory=list)  # released when the step commits
    drafts: int = 0  # drafts of the step in flight


class ColumnStateManager(StateManager):
    """`StateManager`'s checkpoint and hit rules over vLLM's worker columns."""

    moves_on_fast_commit = False

    def init_kind(self) -> None:
        super().init_kind()
        K = self.num_spec_states
        if self.checkpoints and self.block_size <= K:
            raise InvariantError(
                f"group {self.group_id}: {K} speculative tokens with a {self.block_size}-token "
                "state block: a step's drafts may cross two boundaries, which the worker's "
                "post-copy does not checkpoint; use fewer speculative tokens or larger blocks"
            )

    def new_state(self) -> ColumnBlocks:
        return ColumnBlocks()

    def hit_state(
        self,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        hit: int,
        found: dict[int, BlockId] | None,
    ) -> ColumnBlocks | None:
        state = super().hit_state(hashes, root, tokens, hit, found)
        return None if state is None else ColumnBlocks(running=state.running)

    # ------------------------------------------------------------------ a step
    def _column(self, end_tokens: int) -> int:
        """The worker's running column for a step ending at ``end_tokens`` (drafts
        included); ``none`` mode keeps one column."""
        return -(-end_tokens // self.block_size) - 1 if self.checkpoints else 0

    def _fresh(self, state: ColumnBlocks, c: int, cur: int) -> int:
        """Blocks this step takes from the pool (see `place` for where they go)."""
        K = self.num_spec_states
        if state.cur < 0:  # the first step of a run: the whole window, maybe a copy
            inside = state.running is not None and c % self.block_size != 0
            return K + 1 + int(inside and (c - 1) // self.block_size != cur)
        if cur <= state.cur:
            return 0
        moved = sum(1 for col in state.cols if state.cur < col < cur)
        return max(0, cur + K + 1 - max(len(state.row), cur) - moved)

    def _drafts(self, lookahead: int) -> int:
        """Drafts scheduled this step: the lookahead less the drafter's own (its KV
        slots in attention groups; the worker's running column counts drafts only)."""
        return min(max(lookahead - self.drafter_lookahead_tokens, 0), self.num_spec_states)

    def num_new_blocks(self, state: StateBlocks, c: int, n: int, lookahead: int) -> int:
        assert isinstance(state, ColumnBlocks)
        d = self._drafts(lookahead)
        return self._fresh(state, c, self._column(c + n + d))

    def place(
        self, state: StateBlocks, c: int, n: int, lookahead: int, new: list[BlockId]
    ) -> list[BlockId]:
        assert isinstance(state, ColumnBlocks)
        d = self._drafts(lookahead)
        cur = self._column(c + n + d)
        fresh = list(new)
        state.drafts = d
        if state.cur < 0:
            self._start(state, c, cur, fresh)
        elif cur > state.cur:
            self._advance(state, cur, fresh)
        elif cur < state.cur:
            # fewer tokens than the last step's drafts reached: the column left behind
            # (still held until its boundary is reached) runs again, the old one is scratch
            if state.left != cur:
                raise InvariantError(
                    f"group {self.group_id}: the running column goes back to {cur} from "
                    f"{state.cur}, but column {state.left} is the one held behind"
                )
            state.left = -1
        state.cur = cur
        state.write = state.cols[cur]
        if fresh:
            raise InvariantError(f"group {self.group_id}: {len(fresh)} blocks left unplaced")
        return new

    def _start(self, state: ColumnBlocks, c: int, cur: int, fresh: list[BlockId]) -> None:
        """Admission (or resumption) at ``c`` computed tokens, from the hit block
        ``state.running`` when ``c > 0``."""
        B = self.block_size
        K = self.num_spec_states
        row = state.row
        prev = (c - 1) // B if self.checkpoints else -1
        hit = state.running
        if hit is not None and c % B == 0 and prev >= 0:
            # a checkpoint: the worker's pre-copy reads it from column prev (< cur)
            row.extend([_NULL] * prev)
            row.append(hit)
            state.cols[prev] = hit
            state.left = prev
        elif hit is not None:
            # a turn-end entry inside an interval: cached, so never written; the step
            # starts from a private copy in its column (the post-copy may write there)
            copy = fresh.pop(0)
            state.copies.append((hit, copy))
            state.drop.append(hit)
            col = max(prev, 0)
            row.extend([_NULL] * (col - len(row)))
            row.append(copy)
            state.cols[col] = copy
            if col != cur:
                state.left = col
        row.extend([_NULL] * (cur - len(row)))
        for col in range(len(row), cur + K + 1):
            row.append(fresh.pop(0))
            state.cols[col] = row[col]
        state.running = None

    def _advance(self, state: ColumnBlocks, cur: int, fresh: list[BlockId]) -> None:
        """``cur`` moves forward: the old running column stays behind (a checkpoint
        may land there), scratch columns before ``cur`` move to the row's end."""
        K = self.num_spec_states
        if state.left >= 0:  # passed: nothing reads or writes it any more
            state.drop.append(state.cols.pop(state.left))
        state.left = state.cur
        moved = [state.cols.pop(col) for col in sorted(state.cols) if state.cur < col < cur]
        state.row.extend([_NULL] * (cur - len(state.row)))  # skipped columns: null
        for col in range(len(state.row), cur + K + 1):
            block = moved.pop(0) if moved else fresh.pop(0)
            state.row.append(block)
            state.cols[col] = block
        if moved:
            raise InvariantError(f"group {self.group_id}: scratch blocks {moved} left unplaced")

    def reserve_blocks(self, state: StateBlocks, start_max: int, n: int, lookahead: int) -> int:
        # the next step's running column is at most the one its latest start gives (one
        # past ``cur`` at most: its 1 + K tokens fit in a block); the worker reads K
        # scratch columns after it
        assert isinstance(state, ColumnBlocks)
        if state.cur < 0:
            raise InvariantError(f"group {self.group_id}: a step ahead of a request's first")
        cur = self._column(start_max + n + self._drafts(lookahead))
        return max(0, cur + self.num_spec_states + 1 - len(state.row))

    def reserve(
        self, state: StateBlocks, start_max: int, n: int, lookahead: int, new: list[BlockId]
    ) -> None:
        # scratch columns at the row's end: a step that moves ``cur`` finds them there
        # (`_advance` appends only past the row); one that does not leaves them unread
        assert isinstance(state, ColumnBlocks)
        for block in new:
            state.cols[len(state.row)] = block
            state.row.append(block)

    def slots(self, state: StateBlocks, c: int, n: int, lookahead: int) -> StepSlots:
        assert isinstance(state, ColumnBlocks)
        cur = state.cur
        return StepSlots(
            num_computed_tokens=c,
            read_block=None,
            write_block=state.cols[cur],
            write_num_tokens=c + n,
            spec_blocks=tuple(state.row[cur + 1 : cur + 1 + state.drafts]),
            columns=tuple(state.row),
            copies=tuple(state.copies),
        )

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
        assert isinstance(state, ColumnBlocks)
        B = self.block_size
        cur = state.cur
        c2 = c + n + accepted
        state.whole_at = c + n
        if self.checkpoints:
            end = c + n + state.drafts
            stopped = c2 >= len(tokens)  # no token after c2: the request stopped in the step
            if stopped and accepted < state.drafts and end == (cur + 1) * B:
                # the worker may have accepted more than the tokens kept: its post-copy
                # may have moved the boundary's state into column cur
                state.whole_at = -1
            boundary = c2 // B * B
            if boundary >= c + n and boundary > 0:
                dest = boundary // B - 1
                block = state.cols.get(dest)
                if block is None:
                    raise InvariantError(
                        f"group {self.group_id}: the post-copy writes the state after "
                        f"{boundary} into column {dest}, which the request does not hold"
                    )
                if dest == cur:
                    state.whole_at = c2
                if self._store_checkpoint(block, boundary, hashes, root, tokens) and dest != cur:
                    state.cols.pop(dest)
                    self.pool.release(block)
                    state.left = -1
            if state.left >= 0 and c2 >= (state.left + 1) * B:
                state.drop.append(state.cols.pop(state.left))
                state.left = -1
        if state.junction and c2 >= state.junction:
            state.junction = 0
        state.copies = []
        if state.drop:
            self.pool.release_many(state.drop)
            state.drop = []
        return None

    def _store_checkpoint(
        self,
        block: BlockId,
        pos: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
        junction: bool = False,
    ) -> bool:
        if self.pool.is_cached(block):
            return False
        return super()._store_checkpoint(block, pos, hashes, root, tokens, junction)

    def settle_fast(self, state: StateBlocks, accepted: int) -> None:
        raise InvariantError(f"group {self.group_id}: worker columns have no fast commit")

    def settle_fast_all(self, states: list[StateBlocks], accepted: int) -> None:
        raise InvariantError(f"group {self.group_id}: worker columns have no fast commit")

    def fast_bounds(self, state: StateBlocks, c: int) -> Bounds:
        # every step moves columns or may checkpoint: always the checked path
        return (c, c, 0, 0)

    # ------------------------------------------------------------------ release
    def turn_end_tokens(self, state: StateBlocks, c: int) -> int:
        # the running column's whole state (after accepted drafts, the state after c is
        # split over two columns); -1 (unknown) keeps no turn end
        assert isinstance(state, ColumnBlocks)
        return min(state.whole_at, c) if self.checkpoints else c

    def keep_turn_end(
        self,
        state: StateBlocks,
        c: int,
        hashes: Sequence[bytes],
        root: bytes,
        tokens: Sequence[int],
    ) -> None:
        assert isinstance(state, ColumnBlocks)
        end = state.whole_at
        block = state.cols.get(state.cur)
        if (
            not self.checkpoints
            or block is None
            or end != c
            or end <= 0
            or end % self.block_size == 0
            or self.cacheable_end(end, len(tokens)) != end
            or self.pool.is_cached(block)
        ):
            return
        if store_turn_end(self, block, hashes, root, tokens, end):
            self.counters.checkpoints_stored += 1
            self.pool.release(block, dead=True)  # first to evict (`cache.turn_end`)
            del state.cols[state.cur]

    def detach(self, state: StateBlocks) -> list[BlockId]:
        assert isinstance(state, ColumnBlocks)
        out = self.held(state)[::-1]
        state.running = state.write = None
        state.cols = {}
        state.row = []
        state.drop = []
        state.copies = []
        state.cur = state.left = state.whole_at = -1
        state.junction = 0
        return out

    def held(self, state: StateBlocks) -> list[BlockId]:
        assert isinstance(state, ColumnBlocks)
        out = [] if state.running is None else [state.running]
        out += state.cols.values()
        out += [b for b in state.drop if b not in state.cols.values()]
        return out

    def check_state(self, state: StateBlocks, c: int) -> None:
        assert isinstance(state, ColumnBlocks)
        held = self.held(state)
        if len(held) != len(set(held)):
            raise InvariantError(f"group {self.group_id}: a state block is held twice {held}")
        if len(held) > self.budget_blocks + 1:
            raise InvariantError(
                f"group {self.group_id}: {len(held)} state blocks held, budget "
                f"{self.budget_blocks} + 1 hit block"
            )
        for col, block in state.cols.items():
            if not 0 <= col < len(state.row) or state.row[col] != block:
                raise InvariantError(
                    f"group {self.group_id}: column {col} holds {block}, the worker's row "
                    f"{state.row}"
                )
        if state.cur >= 0 and state.cur not in state.cols:
            raise InvariantError(f"group {self.group_id}: running column {state.cur} not held")
        if state.whole_at > c:
            raise InvariantError(
                f"group {self.group_id}: a whole state after {state.whole_at} tokens, only "
                f"{c} computed"
            )
