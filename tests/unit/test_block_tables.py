"""Persistent block tables: rows follow the manager's rows through appends, window
releases, preemption restarts and finished requests, writing only what changed (whole
rows diffed: the oracle; the scheduler's deltas: what the engine runs)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from hybridkv.cache.delta import GroupDelta, StepDelta  # noqa: E402
from hybridkv.engine.forward.block_tables import (  # noqa: E402
    NULL_BLOCK,
    DeviceBlockTables,
    PersistentBlockTable,
)
from hybridkv.errors import EngineError  # noqa: E402


@pytest.mark.parametrize("seed", range(10))
def test_rows_follow_random_updates(seed):
    rng = random.Random(seed)
    table = PersistentBlockTable(4, torch.device("cpu"), initial_rows=2, initial_columns=2)
    truth: dict[str, list[int]] = {}
    live: set[str] = set()
    for step in range(200):
        op = rng.random()
        req = f"r{rng.randrange(8)}"
        if op < 0.15 and req in live:  # finished: the manager forgets it
            live.discard(req)
            truth.pop(req, None)
            if rng.random() < 0.5:
                table.release(req)
            continue
        live.add(req)
        row = truth.setdefault(req, [])
        if op < 0.25:
            row.clear()  # preempted: restarts with no blocks
        elif op < 0.4 and row:
            cut = rng.randrange(len(row))
            row[:cut] = [NULL_BLOCK] * cut  # sliding window released its oldest blocks
        else:
            row.extend(rng.randrange(1, 100) for _ in range(rng.randrange(0, 3)))
        writes, changed = table.num_writes, table.host.get(req, []) != row
        index = table.apply(req, list(row), live.__contains__)
        assert table.num_writes == writes + changed
        got = table.table([index], [len(row)]).block_ids[0].tolist()
        assert got[: len(row)] == row, f"step {step}"
        table.check_invariants()


def test_unchanged_row_writes_nothing_and_dead_rows_are_reused():
    table = PersistentBlockTable(16, torch.device("cpu"), initial_rows=1, initial_columns=4)
    assert table.apply("a", [3, 5], lambda r: True) == 0
    writes = table.num_writes
    table.apply("a", [3, 5], lambda r: True)
    assert table.num_writes == writes
    # "a" finished: its row is reclaimed (and cleared) for "b" instead of growing
    assert table.apply("b", [7], lambda r: r == "b") == 0
    assert table.ids.shape[0] == 1
    assert table.ids[0].tolist() == [7, 0, 0, 0]
    table.check_invariants()


def test_deltas_write_only_what_changed_in_one_store():
    """The module doc's example: a tail block, a window release, a release and a
    readmission, each one device store; rows match the host copies throughout."""
    tables = DeviceBlockTables({0: 4}, torch.device("cpu"))
    table = tables.groups[0]

    def step(released=(), deltas=None):
        tables.apply_step(tuple(released), deltas or {})
        tables.check_invariants()
        return {r: table.host[r] for r in table.rows}

    assert step(deltas={"a": StepDelta({0: GroupDelta(0, (7, 2))}, admitted=True)}) == {"a": [7, 2]}
    writes = table.num_writes
    assert step(deltas={"a": StepDelta({0: GroupDelta(2, (9,))})}) == {"a": [7, 2, 9]}
    assert step() == {"a": [7, 2, 9]} and table.num_writes == writes + 1  # nothing changed
    assert step(deltas={"a": StepDelta({0: GroupDelta(3, (4,), (0, 1))})}) == {"a": [0, 2, 9, 4]}
    assert table.ids[table.rows["a"], :5].tolist() == [0, 2, 9, 4, 0]
    assert step(released=["a"]) == {} and not table.ids.any()
    back = step(deltas={"a": StepDelta({0: GroupDelta(0, (5, 8))}, admitted=True)})
    assert back == {"a": [5, 8]}
    assert tables.table(0, ["a"]).block_ids.tolist() == [[5, 8]]
    # an admission over a stale row (never released) replaces it, nulls included
    assert step(deltas={"a": StepDelta({0: GroupDelta(0, (3,))}, admitted=True)}) == {"a": [3]}
    assert table.ids[table.rows["a"], :3].tolist() == [3, 0, 0]


def test_a_row_that_was_never_given_is_a_typed_error():
    tables = DeviceBlockTables({0: 4}, torch.device("cpu"))
    with pytest.raises(EngineError, match="no block table row"):
        tables.table(0, ["ghost"])
