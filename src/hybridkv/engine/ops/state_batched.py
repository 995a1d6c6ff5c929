"""Recurrent-state plumbing batched across requests: read slots, causal conv, write points.

`state_ops` is the per-request reference (one request, one slot, a Python loop over
tokens); this module does the same for a whole step in a few tensor ops, so a decode
step of 32 requests costs about what one request costs. Per state group and step:

    parts      requests split by new-token count (decode/verify rows vs prefill chunks,
               `varlen.split_by_length`), each part a padded ``[R, L]`` grid
    read       ``buffer[read_slots]`` for rows with an initial state, zeros otherwise
               (never the slot's old contents: a recomputed request starts clean)
    scan       the family's kernel over the grid (padding cells leave the state as is)
    write      every write point ``(k, slot)`` of every row in one indexed store:
               ``buffer[slots] = states_after[k, row]``

Example, two rows, rows 0 decodes 1 token from slot 5 in place, row 1 verifies 1 + 2
drafts from slot 3 with points (1, 3) (2, 8) (3, 9)::

    point_rows  [0, 1, 1, 1]     point_k [1, 1, 2, 3]     point_slots [5, 3, 8, 9]

All reads happen before any write of the step, so an in-place point is safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.engine.ops import compiled
from hybridkv.engine.ops.context import ForwardBatch
from hybridkv.engine.ops.tree_batch import TreeLayout, root_paths
from hybridkv.engine.ops.varlen import Padded, padded_for, split_by_length
from hybridkv.errors import EngineError

# Parts with at most this many new tokens per request run the token-by-token recurrence;
# longer ones (prefill chunks) a chunked form where the family has one.
SHORT_MAX_TOKENS = 8


# A decode step whose slots split into more runs than this gathers and scatters instead:
# each run is one more kernel call (about ten small ops), a gather of 32 rows costs
# about as much as a few of them.
MAX_SLOT_RUNS = 4


@dataclass(frozen=True)
class SlotRun:
    """Rows ``first_row .. first_row + num_rows - 1`` of a part read and write back slots
    ``first_slot + i * slot_step`` (``slot_step >= 1``)."""

    first_row: int
    num_rows: int
    first_slot: int
    slot_step: int

    @property
    def rows(self) -> slice:
        return slice(self.first_row, self.first_row + self.num_rows)

    @property
    def slots(self) -> slice:
        return slice(
            self.first_slot,
            self.first_slot + self.slot_step * (self.num_rows - 1) + 1,
            self.slot_step,
        )


@dataclass(frozen=True)
class StatePart:
    """One padded part of a step for one state group: reads and write points."""

    layout: Padded
    read_slots: torch.Tensor  # [R], int64 (0 where the row has no initial state)
    has_initial: torch.Tensor  # [R], bool
    point_rows: torch.Tensor  # [P], row of the part
    point_k: torch.Tensor  # [P], tokens of the row after which the state is stored
    point_slots: torch.Tensor  # [P], slot written
    point_k_host: tuple[int, ...]
    point_rows_host: tuple[int, ...]
    all_initial: bool  # every row reads a slot (decode): no zero rows to select
    # Every point is "after k tokens" for one k (decode: k = 1), and point p is row p:
    # the states to store are then one slice of the grid, no per-point pick.
    uniform_k: int | None = None
    rows_identity: bool = False
    # Decode where row r reads and writes back one slot of its own, the rows split into
    # at most `MAX_SLOT_RUNS` runs whose slots are arithmetic progressions: each run's
    # states are a strided view of the buffer the kernel can update in place (no gather,
    # no scatter). None otherwise.
    slot_runs: tuple[SlotRun, ...] | None = None
    # Decode where row r reads and writes back one slot of its own (distinct slots, none
    # the null slot 0), however many runs: the compiled core updates them in place.
    in_place: bool = False

    @property
    def slot_range(self) -> tuple[int, int] | None:
        """``(start, step)`` when one run covers every row (slots ``start + r * step``)."""
        if self.slot_runs is None or len(self.slot_runs) != 1:
            return None
        run = self.slot_runs[0]
        return run.first_slot, run.slot_step


def state_parts(batch: ForwardBatch, group: str) -> list[StatePart]:
    """The step's parts for state ``group`` (built once per step, shared by its layers)."""
    return batch.memoized(("state_parts", group), lambda: _build_parts(batch, group))


def _build_parts(batch: ForwardBatch, group: str) -> list[StatePart]:
    if batch.tree is not None:  # token trees: one row per root-to-leaf path
        return tree_state_parts(batch, group)
    slots = batch.slots(group)
    slot_ids = [int(x) for x in slots.slot_ids.tolist()]
    has_initial = [bool(x) for x in slots.has_initial_state.tolist()]
    lengths, computed = batch.host_lengths, batch.host_computed
    device = batch.input_ids.device
    parts = []
    for reqs in split_by_length(lengths, SHORT_MAX_TOKENS):
        rows: list[int] = []
        ks: list[int] = []
        targets: list[int] = []
        for row, r in enumerate(reqs):
            if has_initial[r] and computed[r] == 0:
                raise EngineError(
                    f"request {r} claims an initial state in group {group!r} but has 0 "
                    "computed tokens"
                )
            for k, slot in slots.points(r, lengths[r]):
                rows.append(row)
                ks.append(int(k))
                targets.append(int(slot))
        layout = padded_for(batch, reqs)
        reads = [slot_ids[r] for r in reqs]
        # every row has an initial state and point p is row p
        one_each = rows == list(range(len(reqs))) and all(has_initial[r] for r in reqs)

        def dev(values: list[int]) -> torch.Tensor:
            # Shared by every state group of the step that has the same values (rows
            # and k of the points usually are): one host-to-device tensor, not one each.
            return batch.memoized(
                ("long", tuple(values)),
                lambda: torch.tensor(values, dtype=torch.long).to(device),
            )

        def flags(values: tuple[bool, ...]) -> torch.Tensor:
            return batch.memoized(("bool", values), lambda: torch.tensor(values).to(device))

        parts.append(
            StatePart(
                layout=layout,
                read_slots=dev([slot_ids[r] if has_initial[r] else 0 for r in reqs]),
                has_initial=flags(tuple(has_initial[r] for r in reqs)),
                point_rows=dev(rows),
                point_k=dev(ks),
                point_slots=dev(targets),
                point_k_host=tuple(ks),
                point_rows_host=tuple(rows),
                all_initial=all(has_initial[r] for r in reqs),
                uniform_k=ks[0] if ks and len(set(ks)) == 1 else None,
                rows_identity=rows == list(range(len(reqs))),
                slot_runs=_slot_runs(reads, targets, ks, one_each),
                in_place=one_each and _in_place(reads, targets, ks),
            )
        )
    return parts


def _slot_runs(
    reads: list[int], writes: list[int], ks: list[int], one_read_one_point: bool
) -> tuple[SlotRun, ...] | None:
    """Runs of rows whose slots are progressions, when every row reads its own slot and
    writes it back after 1 token (``one_read_one_point``: every row has an initial state
    and point p is row p); None otherwise or past `MAX_SLOT_RUNS` runs. Greedy, left to
    right: a run takes the step to its second row and extends while the step holds.
    Example, a shared-prefix batch whose first request prefilled alone: slots ``[23,
    247, 254, 261]`` -> runs (rows 0..1, slots 23, 247: step 224) and (rows 2..3, slots
    254, 261: step 7); two runs either way."""
    if not one_read_one_point or not _in_place(reads, writes, ks):
        return None
    runs: list[SlotRun] = []
    row = 0
    while row < len(reads):
        step = reads[row + 1] - reads[row] if row + 1 < len(reads) else 1
        if step < 1:
            step = 1
            end = row + 1
        else:
            end = row + 1
            while end < len(reads) and reads[end] - reads[end - 1] == step:
                end += 1
        runs.append(SlotRun(row, end - row, reads[row], step if end - row > 1 else 1))
        if len(runs) > MAX_SLOT_RUNS:
            return None
        row = end
    return tuple(runs)


def _in_place(reads: list[int], writes: list[int], ks: list[int]) -> bool:
    """Row r reads slot ``reads[r]`` and stores its state after 1 token back there,
    every slot distinct (two rows on one slot: no in-place update) and none the null
    slot 0 (a request never holds it; padding rows use it)."""
    return (
        bool(reads)
        and reads == writes
        and all(k == 1 for k in ks)
        and len(set(reads)) == len(reads)
        and 0 not in reads
    )


def slot_views(buffer: torch.Tensor, part: StatePart) -> list[torch.Tensor] | None:
    """Per `StatePart.slot_runs` run, its rows' slots of ``buffer`` as one strided view;
    None where the part has no runs."""
    if part.slot_runs is None:
        return None
    views = []
    for run in part.slot_runs:
        last = run.first_slot + run.slot_step * (run.num_rows - 1)
        if last >= buffer.shape[0]:
            raise EngineError(
                f"state slots {run.first_slot}..{last} (step {run.slot_step}) run past "
                f"the buffer's {buffer.shape[0]} slots"
            )
        views.append(buffer[run.slots])
    return views


def gather_state(buffer: torch.Tensor, part: StatePart) -> torch.Tensor:
    """``buffer[read_slot]`` per row, zeros for rows without an initial state (selected,
    not multiplied: NaN in an unused slot cannot leak)."""
    # index_select, not ``buffer[slots]``: the same copy, measured 4-5x faster for
    # [32, 8, 64, 64] float32 rows of a strided pool view (0.15-0.19 vs 0.7-1.1 ms)
    read = buffer.index_select(0, part.read_slots)
    if part.all_initial:
        return read
    keep = part.has_initial.view(-1, *([1] * (read.dim() - 1)))
    return torch.where(keep, read, torch.zeros((), dtype=read.dtype, device=read.device))


def causal_conv_grid(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``x [R, L, C]`` continuing from ``state [R, C, rows]``.

    Returns the output ``[R, L, C]`` (before activation) and the history
    ``[R, C, rows + L]`` (the state after ``k`` tokens of row r is
    ``history[r, :, k : k + rows]``), as `state_ops.causal_conv1d_history` per request.

    The history is kept channels-last (``[R, rows + L, C]`` in memory, returned as its
    transposed view) and the conv is one multiply plus ``kernel - 1`` shifted
    multiply-adds over it: no transpose of ``x``, no per-call weight reorder, the same
    tap order for prefill and decode. Measured for ``[32, 256, 1024]``, kernel 4, one
    thread: 29 ms (history) + 45 ms (taps), against 58 + 93 ms for a channels-first
    history and `F.conv1d` (oneDNN depthwise), with equal values on that input.

    ``silu`` (no bias; `engine.ops.compiled`, opt-in, reduced precision only): the taps and
    the silu after them run as one compiled pass, and the output is after the silu.
    """
    kernel = weight.shape[-1]
    rows = state.shape[-1]
    if rows < kernel - 1:
        raise EngineError(f"conv state has {rows} columns but the kernel needs {kernel - 1}")
    length = x.shape[1]
    history = torch.cat([state.to(x.dtype).transpose(1, 2), x], dim=1)  # [R, rows + L, C]
    taps = weight.to(x.dtype)
    first = rows - (kernel - 1)  # the oldest column the first output reads
    if silu and bias is None:
        return compiled.conv_silu(history, taps, first, length), history.transpose(1, 2)
    out = history[:, first : first + length] * taps[:, 0]
    for j in range(1, kernel):
        out.addcmul_(history[:, first + j : first + j + length], taps[:, j])
    if bias is not None:
        out.add_(bias.to(x.dtype))
    if silu:
        F.silu(out, inplace=True)
    return out, history.transpose(1, 2)


def write_conv(buffer: torch.Tensor, part: StatePart, history: torch.Tensor) -> None:
    """Store ``history[row, :, k : k + rows]`` at every write point of ``part``."""
    rows = buffer.shape[-1]
    if part.uniform_k is not None:  # one k for all points: a slice, not a gather
        k = part.uniform_k
        window = history[:, :, k : k + rows]
        buffer[part.point_slots] = (window if part.rows_identity else window[part.point_rows]).to(
            buffer.dtype
        )
        return
    cols = part.point_k[:, None] + torch.arange(rows, device=history.device)[None, :]
    picked = history.transpose(1, 2)[part.point_rows[:, None], cols]  # [P, rows, C]
    buffer[part.point_slots] = picked.transpose(1, 2).to(buffer.dtype)


def read_views(views: list[torch.Tensor]) -> torch.Tensor:
    """The rows' states from `slot_views` (one run: the view itself, no copy)."""
    return views[0] if len(views) == 1 else torch.cat(views)


def write_conv_views(views: list[torch.Tensor], part: StatePart, history: torch.Tensor) -> None:
    """`write_conv` for a part with `StatePart.slot_runs` (every point after 1 token, row
    r to its own slot): copy each run's window into its view of the buffer."""
    if part.slot_runs is None:
        raise EngineError("write_conv_views needs a part with slot runs")
    window = history[:, :, 1 : 1 + views[0].shape[-1]]
    for run, view in zip(part.slot_runs, views, strict=True):
        view.copy_(window[run.rows])


def write_ssm(buffer: torch.Tensor, part: StatePart, states: torch.Tensor) -> None:
    """Store ``states [P, ...]`` (one per write point, in point order)."""
    buffer[part.point_slots] = states.to(buffer.dtype)


def write_ssm_rows(buffer: torch.Tensor, part: StatePart, states: torch.Tensor) -> None:
    """Store ``states [R, ...]`` (one per row: the state after ``part.uniform_k`` tokens)
    at every write point; only for parts whose points all share that k."""
    if part.uniform_k is None:
        raise EngineError("write_ssm_rows needs write points that all share one k")
    buffer[part.point_slots] = (states if part.rows_identity else states[part.point_rows]).to(
        buffer.dtype
    )


def capture_steps(part: StatePart) -> tuple[list[int], torch.Tensor]:
    """Distinct ``k`` of the part's write points, and each point's index among them (for
    recurrences that keep the states after those ``k`` only)."""
    distinct = sorted(set(part.point_k_host))
    where = {k: i for i, k in enumerate(distinct)}
    index = torch.tensor([where[k] for k in part.point_k_host], dtype=torch.long)
    return distinct, index.to(part.point_k.device)


def tree_state_parts(batch: ForwardBatch, group: str) -> list[StatePart]:
    """`state_parts` for a step with trees: each tree request becomes one
    row per root-to-leaf path (`tree_batch` module docstring); plain requests keep their row."""
    tree: TreeLayout = batch.tree
    slots = batch.slots(group)
    slot_ids = [int(x) for x in slots.slot_ids.tolist()]
    has_initial = [bool(x) for x in slots.has_initial_state.tolist()]
    starts, lengths, computed = batch.host_starts, batch.host_lengths, batch.host_computed
    # rows: (request, stream indices, owned flags); points: (row, k, slot)
    short: tuple[list[tuple[int, list[int], list[bool]]], list[tuple[int, int, int]]] = ([], [])
    long: tuple[list[tuple[int, list[int], list[bool]]], list[tuple[int, int, int]]] = ([], [])
    for r in range(batch.num_reqs):
        n, s = lengths[r], starts[r]
        if n == 0:
            continue
        if has_initial[r] and computed[r] == 0:
            raise EngineError(
                f"request {r} claims an initial state in group {group!r} but has 0 computed tokens"
            )
        parents = tree.parents[r]
        paths = [list(range(n))] if parents is None else root_paths(parents)
        rows, points = short if max(map(len, paths)) <= SHORT_MAX_TOKENS else long
        if parents is not None and rows is long:
            raise EngineError(
                f"request {r}: a tree path of {max(map(len, paths))} tokens; tree paths "
                f"must fit {SHORT_MAX_TOKENS} tokens (the state kernels' short rows)"
            )
        where: dict[int, tuple[int, int]] = {}  # token -> (row, index in the path)
        for path in paths:
            owned = [t not in where for t in path]
            for i, t in enumerate(path):
                where.setdefault(t, (len(rows), i))
            rows.append((r, [s + t for t in path], owned))
        for k, slot in slots.points(r, n):
            row, i = where[k - 1] if k > 0 else (where[paths[0][0]][0], -1)
            points.append((row, i + 1, int(slot)))
    device = batch.input_ids.device
    out = []
    for rows, points in (short, long):
        if not rows:
            continue
        out.append(_tree_part(rows, points, slot_ids, has_initial, batch.num_tokens, device))
    return out


def _tree_part(
    rows: list[tuple[int, list[int], list[bool]]],
    points: list[tuple[int, int, int]],
    slot_ids: list[int],
    has_initial: list[bool],
    num_tokens: int,
    device: torch.device,
) -> StatePart:
    width = max(len(tokens) for _, tokens, _ in rows)
    gather: list[int] = []
    scatter: list[int] = []
    owners: list[int] = []
    for row, (_, tokens, owned) in enumerate(rows):
        gather.extend(tokens + [num_tokens] * (width - len(tokens)))
        for i, (t, mine) in enumerate(zip(tokens, owned, strict=True)):
            if mine:
                scatter.append(row * width + i)
                owners.append(t)
    lengths = [len(tokens) for _, tokens, _ in rows]
    lengths_t = torch.tensor(lengths, dtype=torch.long)

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device)

    layout = Padded(
        reqs=tuple(r for r, _, _ in rows),
        lengths=tuple(lengths),
        max_len=width,
        lengths_t=lengths_t.to(device),
        gather=dev(gather),
        scatter=dev(scatter),
        tokens=dev(owners),
        valid=(torch.arange(width)[None, :] < lengths_t[:, None]).to(device),
        identity=False,
    )
    reqs = [r for r, _, _ in rows]
    return StatePart(
        layout=layout,
        read_slots=dev([slot_ids[r] if has_initial[r] else 0 for r in reqs]),
        has_initial=torch.tensor([has_initial[r] for r in reqs]).to(device),
        point_rows=dev([p[0] for p in points]),
        point_k=dev([p[1] for p in points]),
        point_slots=dev([p[2] for p in points]),
        point_k_host=tuple(p[1] for p in points),
        point_rows_host=tuple(p[0] for p in points),
        all_initial=all(has_initial[r] for r in reqs),
    )
