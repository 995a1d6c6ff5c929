"""Fast paths for bf16 models (round 9 of docs/engine_perf.md) against the paths they
replace: the decode update of bf16 ssm states through slot-run views, bit for bit
against the gather / scatter path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine import state_batched  # noqa: E402
from hybridkv.engine.context import StateCache  # noqa: E402
from hybridkv.engine.state_batched import state_parts  # noqa: E402
from tests.engine.test_decode_fast_paths import slots_case  # noqa: E402


@pytest.mark.parametrize("slots", [[2, 4, 6, 8], [23, 247, 254, 261, 268], [9, 2, 4, 6, 30, 31]])
def test_bf16_state_slot_runs_equal_gather_path_bit_for_bit(monkeypatch, slots):
    """A bf16 ssm buffer (as a bf16 model keeps it): the slot-run views (float32 copy
    in, kernel, cast back through the view) give exactly the gather path's outputs and
    slots, and leave every other slot untouched."""
    layer, batch, x, conv, ssm = slots_case(len(slots), slots)
    ssm = ssm.to(torch.bfloat16)
    (part,) = state_parts(batch, "s")
    assert part.slot_runs is not None  # the path under test
    fast = StateCache(conv.clone(), ssm.clone(), "s")
    got = layer.forward(x, batch, fast, batched=True)
    monkeypatch.setattr(state_batched, "MAX_SLOT_RUNS", 0)  # every step gathers
    _, plain_batch, _, _, _ = slots_case(len(slots), slots)
    (plain_part,) = state_parts(plain_batch, "s")
    assert plain_part.slot_runs is None
    plain = StateCache(conv.clone(), ssm.clone(), "s")
    want = layer.forward(x, plain_batch, plain, batched=True)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert torch.equal(fast.ssm.float().nan_to_num(7.0), plain.ssm.float().nan_to_num(7.0))
    assert torch.equal(fast.conv.nan_to_num(7.0), plain.conv.nan_to_num(7.0))
    untouched = [s for s in range(ssm.shape[0]) if s not in slots]
    assert fast.ssm[untouched].isnan().all()
    assert not torch.equal(fast.ssm[slots].float(), ssm[slots].float())  # states moved
