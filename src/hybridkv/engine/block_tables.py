"""Block tables that live on the device across steps, updated from what changed.

One `PersistentBlockTable` per attention group: a ``[rows, columns]`` id tensor on the
model's device, one row per request that has run, plus a host copy of each row. Each
step `apply` gets the manager's current row for every scheduled request and writes only
the part that differs from the host copy: usually nothing (a decode step inside a block)
or one new tail id; a sliding window's released blocks (now the null block), a
preempted request's restart (a shorter row) and a new request's first blocks are the
same operation. Example, row of request "a" (block_size 4)::

    host copy   [7, 2]          manager  [7, 2, 9]      -> write column 2 := 9
    host copy   [7, 2, 9]       manager  [0, 2, 9]      -> write column 0 := 0 (window)
    host copy   [7, 2, 9]       manager  []             -> columns 0..2 := 0 (preempted)

Rows of requests the manager no longer knows (finished, cancelled) are reclaimed when a
new request needs a row and none is free, or through `release`.

The manager does not hand out per-step block deltas yet, so `apply` diffs the rows it
returns (a C-level list comparison per request; no tensor is built unless a row
changed). Once it does, a delta is the same write (a tail, released columns) without
the comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridkv.cache import NULL_BLOCK as CACHE_NULL_BLOCK
from hybridkv.engine.context import BlockTable
from hybridkv.errors import EngineError

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
        self.num_writes = 0  # rows written (work counter for benchmarks and tests)

    # ------------------------------------------------------------------ updates
    def apply(self, req_id: str, blocks: Sequence[int], is_live: Callable[[str], bool]) -> int:
        """Make ``req_id``'s row equal ``blocks``; returns the row. ``is_live`` says
        whether a request still exists (rows of others may be reclaimed)."""
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

    def table(self, rows: Sequence[int], widths: Sequence[int]) -> BlockTable:
        """The step's `BlockTable`: the given rows, as wide as the widest of them."""
        width = max(1, max(widths, default=0))
        index = torch.tensor(list(rows), dtype=torch.long).to(self.device)
        return BlockTable(self.ids[index, :width], self.block_size)

    # ------------------------------------------------------------------ internals
    def _new_row(self, req_id: str, is_live: Callable[[str], bool]) -> int:
        if not self.free_rows:
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
            raise EngineError(f"block table rows overlap: used {used}, free {self.free_rows}")
        if len(used) + len(self.free_rows) != self.ids.shape[0]:
            raise EngineError(
                f"{len(used)} used + {len(self.free_rows)} free rows != {self.ids.shape[0]}"
            )
        ids = self.ids.cpu()
        for req_id, row in self.rows.items():
            expected = self.host[req_id] + [NULL_BLOCK] * (ids.shape[1] - len(self.host[req_id]))
            if ids[row].tolist() != expected:
                raise EngineError(
                    f"block table row {row} of request {req_id!r} is {ids[row].tolist()}, "
                    f"host copy {self.host[req_id]}"
                )
        for row in self.free_rows:
            if ids[row].any():
                raise EngineError(f"free block table row {row} is not all null")
