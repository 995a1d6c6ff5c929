"""hybridkv's block tables and state slots as the rows vLLM's workers read.

A vLLM worker keeps one row of block ids per request and KV-cache group, and only
ever *appends* to it (a new request's row arrives whole; later steps send the new
blocks). hybridkv's manager is richer, so `WorkerRows` translates each step and
refuses (`InvariantError`) anything an append-only row cannot say, rather than let a
worker read the wrong block.

Token-indexed groups (full, sliding, chunked attention): column ``p`` is block ``p`` of
hybridkv's table. Columns hybridkv later nulls (out of a window) keep their old id in
the worker, which never reads them again.

State groups (Mamba, Gated DeltaNet...), facts of vLLM's worker in ``align`` mode
(vllm/v1/worker/mamba_utils.py ``preprocess_mamba``, vLLM 0.32 / 0.33): with ``B`` the
group's block size, ``c`` computed tokens and ``n`` scheduled ones, the step runs on
the state in column ``cur = ceil((c + n) / B) - 1``, updated in place; before the step
the worker copies column ``prev`` into column ``cur`` when they differ, where ``prev``
is the previous step's ``cur`` (for a new or resumed request ``(c - 1) // B``, -1 when
``c == 0``: zeros). So hybridkv's slots go to::

    cur  <- write_block (the state after c + n)
    prev <- read_block  (the state after c), when prev != cur;
            when prev == cur and read != write (a hit on a cached state inside an
            interval), a block copy read -> write runs before the step instead.

Checkpoints inside a step cannot be written (the worker writes states only where a
step ends): the manager runs with ``checkpoints_inside_steps=False`` and the scheduler
ends prefill chunks on ``B`` boundaries. In ``none`` mode (no prefix caching) the
worker reads column 0: the request's one state block.

With speculative decoding the worker keeps ``K`` draft columns after ``cur`` and splits
a state over two columns after accepted drafts; the manager then lays the row out in
the worker's own terms (``state_layout="columns"``,
`hybridkv.cache.managers.state_columns`) and hands the whole row over
(`StepSlots.columns`), which is appended as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hybridkv.cache.delta import StepDelta
from hybridkv.cache.managers.base import StepSlots
from hybridkv.errors import InvariantError


@dataclass
class RequestRows:
    """What one request's worker rows hold, per group, and each state group's column."""

    rows: list[list[int]]
    state_cols: dict[int, int] = field(default_factory=dict)  # group -> last `cur`


@dataclass(frozen=True)
class StepRows:
    """One step's translation: the ids appended per group and the block copies
    (source, destination) to run before the step."""

    appended: tuple[list[int], ...]
    copies: tuple[tuple[int, int], ...] = ()


class WorkerRows:
    """Rows of every request, for groups described by ``state_block_sizes`` (None for a
    token-indexed group, the block size ``B`` for a state group) and the state mode."""

    def __init__(self, state_block_sizes: Sequence[int | None], *, align: bool) -> None:
        self.state_block_sizes = list(state_block_sizes)
        self.align = align
        self.requests: dict[str, RequestRows] = {}

    def drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def rows(self, req_id: str) -> list[list[int]]:
        found = self.requests.get(req_id)
        return [[] for _ in self.state_block_sizes] if found is None else found.rows

    def same_columns(self, req_id: str, end_tokens: int) -> bool:
        """Whether a step ending at ``end_tokens`` keeps every state group in the column
        the worker used last (then a step that took no block changes no row: inside a
        checkpoint interval the running state is private and updated in place)."""
        record = self.requests.get(req_id)
        if record is None:
            return False
        for gid, col in record.state_cols.items():
            B = self.state_block_sizes[gid]
            if B is not None and self.align and -(-end_tokens // B) - 1 != col:
                return False
        return True

    def step(
        self,
        req_id: str,
        delta: StepDelta,
        slots: Mapping[int, StepSlots],
        num_scheduled_tokens: int,
    ) -> StepRows:
        """Translate one allocated step (``delta`` from `CacheManager.allocate`, the
        state groups' `StepSlots`, vLLM's scheduled tokens incl. drafts)."""
        record = self.requests.get(req_id)
        if record is None or delta.admitted:
            record = RequestRows([[] for _ in self.state_block_sizes])
            self.requests[req_id] = record
        sent = [len(row) for row in record.rows]
        copies: list[tuple[int, int]] = []
        for gid, change in delta.groups.items():
            self._place_run(
                req_id, gid, record.rows[gid], sent[gid], change.start, change.new_blocks
            )
        for gid, slot in slots.items():
            B = self.state_block_sizes[gid]
            if B is None:
                raise InvariantError(f"group {gid} is token-indexed but got state slots")
            row = record.rows[gid]
            if slot.columns:  # the manager lays the row out itself (drafts on state layers)
                self._place_run(req_id, gid, row, sent[gid], 0, slot.columns)
                copies.extend(slot.copies)
                continue
            if slot.checkpoints or slot.spec_blocks:
                raise InvariantError(
                    f"request {req_id!r} group {gid}: {len(slot.checkpoints)} checkpoints and "
                    f"{len(slot.spec_blocks)} speculative states inside a step; vLLM's "
                    "worker writes a state only where a step ends"
                )
            c = slot.num_computed_tokens
            if not self.align:
                self._place(req_id, gid, row, sent[gid], 0, slot.write_block)
                if slot.read_block is not None and slot.read_block != slot.write_block:
                    copies.append((slot.read_block, slot.write_block))
                continue
            cur = -(-(c + num_scheduled_tokens) // B) - 1
            prev = record.state_cols.get(gid, (c - 1) // B)
            self._place(req_id, gid, row, sent[gid], cur, slot.write_block)
            read = slot.read_block
            if read is not None:
                if prev != cur:
                    if prev < 0 or prev > cur:
                        raise InvariantError(
                            f"request {req_id!r} group {gid}: the worker's running state "
                            f"column {prev} is not before this step's column {cur}"
                        )
                    self._place(req_id, gid, row, sent[gid], prev, read)
                elif read != slot.write_block:
                    copies.append((read, slot.write_block))
            record.state_cols[gid] = cur
        appended = tuple(row[n:] for row, n in zip(record.rows, sent, strict=True))
        return StepRows(appended, tuple(copies))

    def _place_run(
        self, req_id: str, gid: int, row: list[int], sent: int, start: int, blocks: Sequence[int]
    ) -> None:
        for i, block in enumerate(blocks):
            pos = start + i
            if pos < sent:
                if block and row[pos] != block:
                    raise InvariantError(
                        f"request {req_id!r} group {gid}: column {pos} holds block "
                        f"{row[pos]} in vLLM's worker, hybridkv moved it to {block}; the "
                        "worker's rows only grow"
                    )
                continue
            if pos > len(row):
                row.extend([0] * (pos - len(row)))
            if pos == len(row):
                row.append(block)
            else:
                row[pos] = block

    def _place(
        self, req_id: str, gid: int, row: list[int], sent: int, pos: int, block: int
    ) -> None:
        if pos < sent:
            if row[pos] != block:
                raise InvariantError(
                    f"request {req_id!r} state group {gid}: column {pos} holds block "
                    f"{row[pos]} in vLLM's worker, hybridkv's state is in {block}"
                )
            return
        if pos >= len(row):
            row.extend([0] * (pos + 1 - len(row)))
        elif row[pos] and row[pos] != block:
            raise InvariantError(
                f"request {req_id!r} state group {gid}: column {pos} gets blocks {row[pos]} "
                f"and {block} in one step"
            )
        row[pos] = block

    def check_invariants(self) -> None:
        for req_id, record in self.requests.items():
            if len(record.rows) != len(self.state_block_sizes):
                raise InvariantError(f"request {req_id!r} has {len(record.rows)} rows")
            for gid, col in record.state_cols.items():
                if not 0 <= col < len(record.rows[gid]):
                    raise InvariantError(
                        f"request {req_id!r} state group {gid}: column {col} outside its row"
                    )


def split_prefill_chunk(
    start: int, num_new_tokens: int, prefill_end: int, block_size: int, junction: int = 0
) -> int:
    """Tokens to schedule in a prefill chunk from ``start``: up to the last state boundary
    (multiple of ``block_size``) strictly inside the chunk, or the junction rule's
    boundary when it comes first, so the state there is written at the chunk's end and
    checkpointed; past ``prefill_end`` (decode) unchanged."""
    if not block_size or start >= prefill_end:
        return num_new_tokens
    end = start + num_new_tokens
    last = (end - 1) // block_size * block_size
    stop = last if last > start else end
    if start < junction < stop:
        stop = junction
    return stop - start
