"""Block tables that live on the device across steps, updated from the manager's deltas.

One `PersistentBlockTable` per attention group (`DeviceBlockTables` holds them, shared by
the main and draft runners): a ``[rows, columns]`` id tensor on the model's device, one
row per running request, plus a host copy of each row. Once per step the engine applies
what the scheduler's output says changed (`SchedulerOutput.released`, then
`SchedulerOutput.deltas`: the `StepDelta` of each allocate that changed a table); a
step of decodes inside their blocks changes nothing and costs nothing. Example, row of
request "a" (block_size 4)::

    host [7, 2]        delta GroupDelta(start=2, new_blocks=(9,))      -> column 2 := 9
    host [7, 2, 9]     delta GroupDelta(3, (4,), nulled_range=(0, 1))  -> [0, 2, 9, 4]
    host [0, 2, 9, 4]  released (finished, cancelled, preempted)      -> row cleared, free
    readmitted         delta admitted=True, (0, (5, 8))                -> [5, 8] (new row)

All writes of a step go to the device as one indexed store per group. `apply` (a whole
row, diffed against the host copy) is the slower oracle the tests compare with, and
`DeviceBlockTables.check_against` compares every scheduled row with the manager's own
(`Stepper.check_tables`, on in tests; env ``HYBRIDKV_CHECK_TABLES=1``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from hybridkv.cache import NULL_BLOCK as CACHE_NULL_BLOCK
from hybridkv.cache.delta import GroupDelta, StepDelta
from hybridkv.engine.ops.context import BlockTable
from hybridkv.errors import EngineError, InvariantError
from hybridkv.plan.types import CachePlan

NULL_BLOCK = int(CACHE_NULL_BLOCK)  # the id the manager puts in released positions


class PersistentBlockTable:
    def __init__(
        self,
        block_size: int,
        device: torch.device,
        *,
        initial_rows: int = 8,
        initial_columns: int = 16,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.ids = torch.zeros(initial_rows, initial_columns, dtype=torch.long, device=device)
        self.rows: dict[str, int] = {}
        self.host: dict[str, list[int]] = {}
        self.free_rows = list(range(initial_rows - 1, -1, -1))
        self.num_writes = 0  # device stores issued (work counter for benchmarks and tests)

    # ------------------------------------------------------------------ updates
    def apply_deltas(
        self, released: Iterable[str], deltas: Iterable[tuple[str, GroupDelta, bool]]
    ) -> None:
        """Drop the rows of ``released`` requests, then apply ``(req_id, delta,
        admitted)`` to the host rows (an admitted delta replaces the row) and store every
        changed cell on the device at once."""
        cells: dict[tuple[int, int], int] = {}  # (row, column) -> id; later writes win
        for req_id in released:
            row = self.rows.pop(req_id, None)
            if row is None:
                continue
            for column in range(len(self.host.pop(req_id))):
                cells[row, column] = NULL_BLOCK
            self.free_rows.append(row)
        width = 0
        for req_id, delta, admitted in deltas:
            row = self.rows.get(req_id)
            if row is None:
                row = self._new_row(req_id, None)
            host = self.host[req_id]
            if admitted:
                for column in range(len(host)):
                    cells[row, column] = NULL_BLOCK
                host.clear()
            for column in delta.nulled:  # as `GroupDelta.apply`, noting each cell
                host[column] = NULL_BLOCK
                cells[row, column] = NULL_BLOCK
            end = delta.start + len(delta.new_blocks)
            if len(host) < end:
                host.extend([NULL_BLOCK] * (end - len(host)))
            for column, block in enumerate(delta.new_blocks, delta.start):
                host[column] = cells[row, column] = int(block)
            width = max(width, len(host))
        if not cells:
            return
        self._ensure_columns(width)
        where = torch.tensor(
            [[r for r, _ in cells], [c for _, c in cells], list(cells.values())], dtype=torch.long
        ).to(self.device)
        self.ids[where[0], where[1]] = where[2]
        self.num_writes += 1

    def apply(self, req_id: str, blocks: Sequence[int], is_live: Callable[[str], bool]) -> int:
        """Make ``req_id``'s row equal ``blocks`` (a whole row, diffed against the host
        copy: the oracle of `apply_deltas`); returns the row. ``is_live`` says whether a
        request still exists (rows of others may be reclaimed)."""
        row = self.rows.get(req_id)
        if row is None:
            row = self._new_row(req_id, is_live)
        old = self.host[req_id]
        if old == blocks:
            return row
        first = next(
            (i for i, (a, b) in enumerate(zip(old, blocks, strict=False)) if a != b),
            min(len(old), len(blocks)),
        )
        self._ensure_columns(len(blocks))
        if first < len(blocks):
            tail = torch.tensor(list(blocks[first:]), dtype=torch.long)
            self.ids[row, first : len(blocks)] = tail.to(self.device)
        if len(blocks) < len(old):
            self.ids[row, len(blocks) : len(old)] = NULL_BLOCK
        self.host[req_id] = list(blocks)
        self.num_writes += 1
        return row

    def release(self, req_id: str) -> None:
        """Forget ``req_id`` (finished, cancelled); its row is cleared for reuse."""
        row = self.rows.pop(req_id, None)
        if row is None:
            return
        width = len(self.host.pop(req_id))
        if width:
            self.ids[row, :width] = NULL_BLOCK
        self.free_rows.append(row)

    def row(self, req_id: str) -> int:
        row = self.rows.get(req_id)
        if row is None:
            raise EngineError(
                f"request {req_id!r} has no block table row: apply the scheduler output's "
                "released and deltas first (DeviceBlockTables.apply_step)"
            )
        return row

    def table(self, rows: Sequence[int], widths: Sequence[int]) -> BlockTable:
        """The step's `BlockTable`: the given rows, as wide as the widest of them."""
        width = max(1, max(widths, default=0))
        index = torch.tensor(list(rows), dtype=torch.long).to(self.device)
        return BlockTable(self.ids[index, :width], self.block_size)

    # ------------------------------------------------------------------ internals
    def _new_row(self, req_id: str, is_live: Callable[[str], bool] | None) -> int:
        if not self.free_rows and is_live is not None:
            for gone in [r for r in self.rows if not is_live(r)]:
                self.release(gone)
        if not self.free_rows:
            grown = self.ids.shape[0]
            self.ids = torch.cat([self.ids, torch.zeros_like(self.ids)])
            self.free_rows = list(range(2 * grown - 1, grown - 1, -1))
        row = self.free_rows.pop()
        self.rows[req_id] = row
        self.host[req_id] = []
        return row

    def _ensure_columns(self, width: int) -> None:
        columns = self.ids.shape[1]
        if width <= columns:
            return
        while columns < width:
            columns *= 2
        wider = torch.zeros(self.ids.shape[0], columns, dtype=torch.long, device=self.device)
        wider[:, : self.ids.shape[1]] = self.ids
        self.ids = wider

    def check_invariants(self) -> None:
        """Each live row equals its host copy, null past it; rows and free rows partition."""
        used = sorted(self.rows.values())
        if len(set(used)) != len(used) or set(used) & set(self.free_rows):
            raise InvariantError(f"block table rows overlap: used {used}, free {self.free_rows}")
        if len(used) + len(self.free_rows) != self.ids.shape[0]:
            raise InvariantError(
                f"{len(used)} used + {len(self.free_rows)} free rows != {self.ids.shape[0]}"
            )
        ids = self.ids.cpu()
        for req_id, row in self.rows.items():
            expected = self.host[req_id] + [NULL_BLOCK] * (ids.shape[1] - len(self.host[req_id]))
            if ids[row].tolist() != expected:
                raise InvariantError(
                    f"block table row {row} of request {req_id!r} is {ids[row].tolist()}, "
                    f"host copy {self.host[req_id]}"
                )
        for row in self.free_rows:
            if ids[row].any():
                raise InvariantError(f"free block table row {row} is not all null")


class DeviceBlockTables:
    """The persistent tables of every attention group of a plan (shared by the main and
    draft runners), updated once per step from the scheduler's output."""

    def __init__(self, block_sizes: Mapping[int, int], device: torch.device) -> None:
        self.device = device
        self.groups = {g: PersistentBlockTable(size, device) for g, size in block_sizes.items()}

    @classmethod
    def for_plan(cls, plan: CachePlan, device: torch.device) -> DeviceBlockTables:
        return cls({g.group_id: g.block_size for g in plan.groups if not g.is_state}, device)

    def apply_step(self, released: Sequence[str], deltas: Mapping[str, StepDelta]) -> None:
        """Drop ``released`` rows, then apply each request's `StepDelta` (module doc)."""
        for group_id, table in self.groups.items():
            table.apply_deltas(
                released,
                (
                    (req_id, step.groups[group_id], step.admitted)
                    for req_id, step in deltas.items()
                    if group_id in step.groups
                ),
            )

    def table(self, group_id: int, req_ids: Sequence[str]) -> BlockTable:
        """Group ``group_id``'s `BlockTable` over ``req_ids`` (rows in that order)."""
        persistent = self.groups[group_id]
        rows = [persistent.row(r) for r in req_ids]
        return persistent.table(rows, [len(persistent.host[r]) for r in req_ids])

    def check_against(self, manager: object, req_ids: Iterable[str]) -> None:
        """Each of ``req_ids`` (requests allocated and not yet committed) has, in every
        group, the row the manager holds (`CacheManager.block_table`); `InvariantError`
        naming the group and both rows otherwise."""
        block_table: Callable[[str, int], list[int]] = manager.block_table  # type: ignore[attr-defined]
        for req_id in req_ids:
            for group_id, table in self.groups.items():
                held = [int(b) for b in block_table(req_id, group_id)]
                mine = table.host.get(req_id)
                if mine != held:
                    raise InvariantError(
                        f"request {req_id!r} group {group_id}: the delta-applied block table "
                        f"row is {mine}, the manager's is {held}"
                    )
        self.check_invariants()

    def check_invariants(self) -> None:
        for table in self.groups.values():
            table.check_invariants()
