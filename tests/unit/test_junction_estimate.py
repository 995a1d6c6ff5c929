"""`junction_partial_gain`: hand-counted gains on a three-request trace."""

from __future__ import annotations

from hybridkv.sim.junction_estimate import junction_partial_gain
from hybridkv.sim.trace import TraceRequest


def _req(i: int, shared: int, total: int) -> TraceRequest:
    """``shared`` tokens common to every request, then tokens unique to request ``i``."""
    prompt = tuple(range(shared)) + tuple(10_000 * (i + 1) + j for j in range(total - shared))
    return TraceRequest(id=f"r{i}", arrival_s=float(i), prompt=prompt, output=(1,))


def test_second_diverging_request_records_the_entry_the_third_hits() -> None:
    # r0 and r1 share 40 tokens; block 16: r1 hits 32 (block-rounded) and records an
    # entry at 40; r2 shares the same 40 tokens and would hit 40 instead of 32.
    trace = [_req(0, 40, 64), _req(1, 40, 64), _req(2, 40, 64)]
    hits = {"r0": 0, "r1": 32, "r2": 32}
    assert junction_partial_gain(trace, hits, 16) == (8, 1)
    # on a block boundary there is nothing to gain
    aligned = [_req(0, 48, 64), _req(1, 48, 64), _req(2, 48, 64)]
    assert junction_partial_gain(aligned, {"r1": 48, "r2": 48}, 16) == (0, 0)
    # a hit short of the block below the entry (evicted blocks) gains nothing either
    assert junction_partial_gain(trace, {"r1": 32, "r2": 16}, 16) == (0, 0)
    # a request that already hits past the entry gains nothing
    assert junction_partial_gain(trace, {"r1": 32, "r2": 40}, 16) == (0, 0)
