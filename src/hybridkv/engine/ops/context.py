"""What one forward step sees: a batch of requests flattened into one token stream.

The runner builds one `ForwardBatch` per step from the scheduler's decisions and the
`CacheManager`'s block tables; models only read it. Request ``r`` owns the token range
``query_start_loc[r] : query_start_loc[r + 1]`` of the stream, and its first new token
sits at position ``num_computed_tokens[r]`` (tokens before it are already in the cache).

    requests   r0 (3 cached, 2 new)   r1 (0 cached, 4 new: fresh prefill)   r2 (decode)
    stream     [a3 a4 | b0 b1 b2 b3 | c9]
    query_start_loc     = [0, 2, 6, 7]
    num_computed_tokens = [3, 0, 9]
    positions           = [3, 4, 0, 1, 2, 3, 9]

Every layer belongs to one *group* (a string key chosen by the runner, e.g. the plan's
group id). Attention groups give each request a block table; state groups give each
request a state slot. A layer finds its table through the group key bound to its cache
(`KVCache.group` / `StateCache.group`), so the model never guesses the grouping.

Logits are computed only at `logits_indices` (indices into the stream). The default is
the last token of each request; speculative verification asks for several per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import torch

from hybridkv.engine.ops.kv_quant import KVQuant
from hybridkv.engine.ops.scratch import Scratch
from hybridkv.errors import EngineError

_T = TypeVar("_T")


@dataclass(frozen=True)
class BlockTable:
    """Block ids of one attention group: row ``r`` maps request ``r``'s logical blocks.

    Token position ``p`` of request ``r`` lives in cache slot
    ``block_ids[r, p // block_size] * block_size + p % block_size``. Entries for blocks a
    request no longer reads (outside a sliding window) may be the null block (id 0).
    """

    block_ids: torch.Tensor  # [num_reqs, max_blocks_per_req], integer
    block_size: int


# (k, slot): after the request's first k new tokens of this step, store the state in slot.
WritePoint = tuple[int, int]


@dataclass(frozen=True)
class StateSlots:
    """State slots of one state group, one read slot and a list of write points per request.

    ``has_initial_state[r]`` is False when request ``r`` starts from an empty state (a
    fresh prefill, or a preempted request being recomputed): ``slot_ids[r]`` is then
    ignored, never read. ``write_points[r]`` lists ``(k, slot)``: the state after the
    request's first ``k`` new tokens of this step goes to ``slot`` (``0 <= k <= n``).
    Without ``write_points`` the only point is ``(n, slot_ids[r])``: update in place.

    One request with c = 14 computed, n = 4 new tokens (positions 14..17), checkpoint
    interval 16, and 2 drafts among the new tokens (n = 2 verified + 2 drafts)::

        position        14   15 | 16   17
        k (after)        1    2 |  3    4
        write points         (2, write)  (3, spec0)  (4, spec1)   align: (2, ckpt@16)

    Points may share a slot with the read slot (in place): every read happens before
    any write of the same request.
    """

    slot_ids: torch.Tensor  # [num_reqs], integer: the read slot
    has_initial_state: torch.Tensor  # [num_reqs], bool
    write_points: tuple[tuple[WritePoint, ...], ...] | None = None

    @classmethod
    def from_points(
        cls,
        reads: Sequence[int | None],
        writes: Sequence[Sequence[WritePoint]],
        device: torch.device | str = "cpu",
    ) -> StateSlots:
        """Build from a read slot (None: start from zeros) and write points per request."""
        if len(reads) != len(writes):
            raise EngineError(f"{len(reads)} read slots but {len(writes)} write-point lists")
        return cls(
            slot_ids=torch.tensor(
                [0 if r is None else r for r in reads], dtype=torch.long, device=device
            ),
            has_initial_state=torch.tensor(
                [r is not None for r in reads], dtype=torch.bool, device=device
            ),
            write_points=tuple(tuple((int(k), int(s)) for k, s in w) for w in writes),
        )

    def points(self, r: int, num_new_tokens: int) -> tuple[WritePoint, ...]:
        """Write points of request ``r`` (default: in place after all its new tokens)."""
        if self.write_points is None:
            return ((num_new_tokens, int(self.slot_ids[r])),)
        return self.write_points[r]


@dataclass(frozen=True)
class ForwardBatch:
    """One step: ``T`` new tokens of ``num_reqs`` requests (see module docstring)."""

    input_ids: torch.Tensor  # [T], int64
    positions: torch.Tensor  # [T], int64
    query_start_loc: torch.Tensor  # [num_reqs + 1], int64, cu_seqlens of the new tokens
    num_computed_tokens: torch.Tensor  # [num_reqs], int64, tokens already in the cache
    block_tables: dict[str, BlockTable] = field(default_factory=dict)
    state_slots: dict[str, StateSlots] = field(default_factory=dict)
    logits_indices: torch.Tensor | None = None  # [N] stream indices; None: last of each req
    # Token trees of the step (`tree_batch.TreeLayout`), None for plain causal chunks.
    tree: Any = None
    # Per-step index tensors that every layer of a group shares (padded layouts, key
    # indices, state write points), built by the first layer that needs them.
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    # The runner's work buffers, kept across steps (`engine.ops.scratch`); None: fresh
    # tensors (tests, the reference paths).
    scratch: Scratch | None = field(default=None, compare=False, repr=False)

    @property
    def num_reqs(self) -> int:
        return int(self.query_start_loc.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @cached_property
    def host_starts(self) -> list[int]:
        """``query_start_loc`` on the host (read once per step, not once per layer)."""
        return [int(x) for x in self.query_start_loc.tolist()]

    @cached_property
    def host_computed(self) -> list[int]:
        return [int(x) for x in self.num_computed_tokens.tolist()]

    @cached_property
    def host_lengths(self) -> list[int]:
        """New tokens per request."""
        starts = self.host_starts
        return [starts[r + 1] - starts[r] for r in range(self.num_reqs)]

    def query_ranges(self) -> list[tuple[int, int, int]]:
        """``(start, end, num_computed)`` per request, as Python ints for per-request loops."""
        starts, computed = self.host_starts, self.host_computed
        return [(starts[r], starts[r + 1], computed[r]) for r in range(self.num_reqs)]

    def memoized(self, key: Any, build: Callable[[], _T]) -> _T:
        """``build()`` once per step for ``key``; later layers get the same object."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]  # type: ignore[no-any-return]

    def selected_indices(self) -> torch.Tensor:
        if self.logits_indices is not None:
            return self.logits_indices
        return self.query_start_loc[1:] - 1

    def block_table(self, group: str) -> BlockTable:
        try:
            return self.block_tables[group]
        except KeyError:
            raise EngineError(
                f"no block table for attention group {group!r}; the batch has "
                f"{sorted(self.block_tables)}"
            ) from None

    def slots(self, group: str) -> StateSlots:
        try:
            return self.state_slots[group]
        except KeyError:
            raise EngineError(
                f"no state slots for state group {group!r}; the batch has "
                f"{sorted(self.state_slots)}"
            ) from None

    def check(self) -> None:
        """Raise `EngineError` if the batch is inconsistent (shapes, positions)."""
        n = self.num_reqs
        if self.positions.shape != self.input_ids.shape or self.input_ids.dim() != 1:
            raise EngineError(
                f"input_ids {tuple(self.input_ids.shape)} and positions "
                f"{tuple(self.positions.shape)} must both be [T]"
            )
        if int(self.query_start_loc[-1]) != self.num_tokens:
            raise EngineError(
                f"query_start_loc ends at {int(self.query_start_loc[-1])} but the batch has "
                f"{self.num_tokens} tokens"
            )
        if self.num_computed_tokens.shape != (n,):
            raise EngineError(
                f"num_computed_tokens has shape {tuple(self.num_computed_tokens.shape)}, "
                f"expected ({n},)"
            )
        # all requests at once: position of stream index i in request r is
        # computed[r] + (i - start[r])
        lengths = torch.tensor(self.host_lengths, dtype=torch.long)
        offsets = torch.tensor(self.host_computed, dtype=torch.long) - torch.tensor(
            self.host_starts[:-1], dtype=torch.long
        )
        expected = torch.arange(self.num_tokens) + offsets.repeat_interleave(lengths)
        wrong = (self.positions.cpu() != expected).nonzero()
        if wrong.numel():
            i = int(wrong[0])
            r = max(q for q in range(n) if self.host_starts[q] <= i)
            start, end, computed = self.query_ranges()[r]
            raise EngineError(
                f"request {r}: positions must run from num_computed_tokens={computed} "
                f"for {end - start} tokens"
            )
        for group, table in self.block_tables.items():
            if table.block_ids.dim() != 2 or table.block_ids.shape[0] != n:
                raise EngineError(
                    f"block table of group {group!r} has shape {tuple(table.block_ids.shape)}, "
                    f"expected ({n}, max_blocks)"
                )
        for group, slots in self.state_slots.items():
            if slots.slot_ids.shape != (n,) or slots.has_initial_state.shape != (n,):
                raise EngineError(f"state slots of group {group!r} must have shape ({n},)")
            if slots.write_points is not None and len(slots.write_points) != n:
                raise EngineError(
                    f"state slots of group {group!r} have {len(slots.write_points)} "
                    f"write-point lists for {n} requests"
                )
            for r, (start, end, _) in enumerate(self.query_ranges()):
                for k, _slot in slots.points(r, end - start):
                    if not 0 <= k <= end - start:
                        raise EngineError(
                            f"request {r} of state group {group!r}: write point after {k} "
                            f"tokens but the step has {end - start} new tokens"
                        )


@dataclass(frozen=True)
class KVCache:
    """Paged K/V of one attention layer, and the group whose block table addresses it."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_blocks, block_size, num_kv_heads, v_head_dim]
    group: str
    quant: KVQuant | None = None  # fp8 pages (or their float32 simulation): `kv_quant`


@dataclass(frozen=True)
class StateCache:
    """Recurrent state of one state layer, indexed by state slot.

    ``conv`` holds the most recent inputs of the causal conv, oldest first; it may keep
    more than ``kernel - 1`` columns (extra rows for speculative tokens), and only the
    last ``kernel - 1`` are read. ``ssm`` is the recurrent matrix (layout per family).
    """

    conv: torch.Tensor  # [num_slots, conv_channels, conv_rows >= kernel - 1]
    ssm: torch.Tensor  # [num_slots, ...]
    group: str


LayerCache = KVCache | StateCache


def make_batch(
    chunks: Sequence[tuple[Sequence[int], int]],
    block_tables: dict[str, BlockTable] | None = None,
    state_slots: dict[str, StateSlots] | None = None,
    logits_indices: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    scratch: Scratch | None = None,
) -> ForwardBatch:
    """Build a batch from ``(new_token_ids, num_computed_tokens)`` per request; its
    tensors live on ``device`` (block tables and state slots are passed in built;
    ``scratch``: the runner's work buffers)."""
    ids: list[int] = []
    positions: list[int] = []
    starts = [0]
    computed: list[int] = []
    for tokens, num_computed in chunks:
        ids.extend(tokens)
        positions.extend(range(num_computed, num_computed + len(tokens)))
        starts.append(len(ids))
        computed.append(num_computed)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
        num_computed_tokens=torch.tensor(computed, dtype=torch.long, device=device),
        block_tables=block_tables or {},
        state_slots=state_slots or {},
        logits_indices=logits_indices,
        scratch=scratch,
    )
