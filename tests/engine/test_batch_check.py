"""`ForwardBatch.check` on positions, checked for all requests at once."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.ops.context import make_batch  # noqa: E402
from hybridkv.errors import EngineError  # noqa: E402


def test_consistent_positions_pass():
    batch = make_batch([([1, 2], 3), ([4], 0), ([5, 6, 7], 9)])
    assert batch.positions.tolist() == [3, 4, 0, 9, 10, 11]
    batch.check()


@pytest.mark.parametrize(("cell", "req"), [(0, 0), (2, 1), (5, 2)])
def test_a_wrong_position_names_its_request(cell, req):
    batch = make_batch([([1, 2], 3), ([4], 0), ([5, 6, 7], 9)])
    positions = batch.positions.clone()
    positions[cell] += 1
    bad = dataclasses.replace(batch, positions=positions)
    with pytest.raises(EngineError, match=f"request {req}: positions must run from"):
        bad.check()
