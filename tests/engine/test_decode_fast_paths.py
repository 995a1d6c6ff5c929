"""The decode fast paths of the batched state kernels against the per-request oracle.

A pure decode step (every row one new token, every write point "after 1 token") takes
`delta_rule.delta_rule_decode_` (state updated in place in its stored layout) and the
slice form of `write_conv` / `write_ssm_rows`; a step whose points all share one k takes
the slice form of `write_conv` too. These tests build exactly such steps (in place,
to another slot, plus a checkpoint copy, rows in shuffled slots, some rows starting
from zeros) and compare outputs and every slot with the reference loop.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.ops import delta_rule, kv_quant, state_batched  # noqa: E402
from hybridkv.engine.ops.context import StateCache, StateSlots, make_batch  # noqa: E402
from hybridkv.engine.ops.scratch import Scratch  # noqa: E402
from hybridkv.engine.ops.state_batched import SlotRun, state_parts  # noqa: E402
from hybridkv.engine.ops.state_ops import gated_delta_rule_capture  # noqa: E402
from tests.exactness.test_batched_kernels import gdn_layer  # noqa: E402


def decode_case(seed: int, *, fresh_rows: bool, new_tokens: int = 1):
    """Rows of ``new_tokens`` new tokens each; every point is after all of them."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(500 + seed)
    num_rows = rng.randrange(1, 9)
    num_slots = 1 + 3 * num_rows
    slots = list(range(1, num_slots))
    rng.shuffle(slots)
    layer = gdn_layer(torch.Generator().manual_seed(seed))
    conv = torch.full((num_slots, layer.shape.conv_dim, 3 + 1), float("nan"))
    ssm = torch.full((num_slots, 4, 4, 8), float("nan"))
    reads, writes, computed = [], [], []
    for _ in range(num_rows):
        mine = [slots.pop() for _ in range(3)]
        fresh = fresh_rows and rng.random() < 0.4
        read = None if fresh else mine[0]
        if read is not None:
            conv[read] = torch.randn(conv.shape[1:], generator=gen)
            ssm[read] = torch.randn(ssm.shape[1:], generator=gen) * 0.3
        target = mine[0] if (read is not None and rng.random() < 0.5) else mine[1]
        points = [(new_tokens, target)]
        if rng.random() < 0.5:  # a checkpoint at the same boundary
            points.append((new_tokens, mine[2]))
        reads.append(read)
        writes.append(points)
        computed.append(0 if fresh else rng.randrange(1, 50))
    batch = make_batch(
        [([1] * new_tokens, c) for c in computed],
        state_slots={"s": StateSlots.from_points(reads, writes)},
    )
    x = torch.randn(num_rows * new_tokens, layer.shape.hidden_size, generator=gen)
    return layer, batch, x, conv, ssm


def assert_batched_equals_reference(layer, batch, x, conv, ssm):
    """The batched forward (in place on ``conv`` / ``ssm``) against the per-request loop
    on copies: outputs and every state slot (NaN slots included) equal."""
    ref = StateCache(conv.clone(), ssm.clone(), "s")
    got_cache = StateCache(conv, ssm, "s")
    got = layer.forward(x, batch, got_cache, batched=True)
    want = layer.forward(x, batch, ref, batched=False)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_cache.conv, ref.conv, equal_nan=True)
    torch.testing.assert_close(got_cache.ssm, ref.ssm, equal_nan=True, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("fresh_rows", [False, True])
@pytest.mark.parametrize("new_tokens", [1, 3])
def test_uniform_point_steps_match_reference(seed, fresh_rows, new_tokens):
    layer, batch, x, conv, ssm = decode_case(seed, fresh_rows=fresh_rows, new_tokens=new_tokens)
    (part,) = state_parts(batch, "s")
    assert part.uniform_k == new_tokens  # the fast paths are the ones under test
    assert_batched_equals_reference(layer, batch, x, conv, ssm)


@pytest.mark.parametrize("seed", range(8))
def test_decode_kernel_matches_recurrence(seed):
    """`delta_rule_decode_` (stored layout, in place) against the per-request oracle."""
    gen = torch.Generator().manual_seed(seed)
    rows, heads, dk, dv = 5, 3, 6, 4
    q, k = (
        torch.randn(rows, 1, heads, dk, generator=gen),
        torch.randn(rows, 1, heads, dk, generator=gen),
    )
    v = torch.randn(rows, 1, heads, dv, generator=gen)
    g = -torch.rand(rows, 1, heads, generator=gen)
    beta = torch.rand(rows, 1, heads, generator=gen)
    state = torch.randn(rows, heads, dk, dv, generator=gen)  # the rule's [dk, dv] layout
    qp, kp, vp, gp, bp = delta_rule.prepare(q, k, v, g, beta)
    stored = state.transpose(-1, -2).contiguous()
    out = delta_rule.delta_rule_decode_(qp, kp, vp, gp, bp, stored)
    for r in range(rows):
        want, states = gated_delta_rule_capture(q[r], k[r], v[r], g[r], beta[r], state[r], [1])
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stored[r].transpose(-1, -2), states[1], rtol=1e-5, atol=1e-6)


def strided_case(seed: int, start: int, step: int, num_rows: int):
    """Decode rows that each read and write back slot ``start + row * step``."""
    return slots_case(seed, [start + r * step for r in range(num_rows)])


def slots_case(seed: int, slots: list[int]):
    """Decode rows where row r reads and writes back ``slots[r]``; every other slot NaN."""
    gen = torch.Generator().manual_seed(900 + seed)
    layer = gdn_layer(torch.Generator().manual_seed(seed))
    num_slots = max(slots) + 3
    num_rows = len(slots)
    conv = torch.full((num_slots, layer.shape.conv_dim, 3 + 1), float("nan"))
    ssm = torch.full((num_slots, 4, 4, 8), float("nan"))
    for slot in slots:
        conv[slot] = torch.randn(conv.shape[1:], generator=gen)
        ssm[slot] = torch.randn(ssm.shape[1:], generator=gen) * 0.3
    batch = make_batch(
        [([1], 5 + r) for r in range(num_rows)],
        state_slots={"s": StateSlots.from_points(slots, [[(1, s)] for s in slots])},
    )
    x = torch.randn(num_rows, layer.shape.hidden_size, generator=gen)
    return layer, batch, x, conv, ssm


@pytest.mark.parametrize(("start", "step", "num_rows"), [(1, 1, 4), (2, 3, 5), (7, 2, 1)])
def test_strided_in_place_decode_matches_reference(start, step, num_rows):
    """Slots in an arithmetic progression: the kernel updates the buffer through a view;
    every slot (NaN ones included) must equal the reference loop's."""
    layer, batch, x, conv, ssm = strided_case(start + step, start, step, num_rows)
    (part,) = state_parts(batch, "s")
    # the view path is the one under test (one row: step 1 by convention)
    assert part.slot_range == (start, step if num_rows > 1 else 1)
    assert_batched_equals_reference(layer, batch, x, conv, ssm)


def test_slot_range_only_for_read_equals_write_progressions():
    def part_for(reads, writes):
        batch = make_batch(
            [([1], 5) for _ in reads],
            state_slots={"s": StateSlots.from_points(reads, writes)},
        )
        (part,) = state_parts(batch, "s")
        return part.slot_range

    assert part_for([4, 6, 8], [[(1, 4)], [(1, 6)], [(1, 8)]]) == (4, 2)
    assert part_for([3], [[(1, 3)]]) == (3, 1)
    assert part_for([4, 6, 9], [[(1, 4)], [(1, 6)], [(1, 9)]]) is None  # not a progression
    assert part_for([8, 6, 4], [[(1, 8)], [(1, 6)], [(1, 4)]]) is None  # step < 1
    assert part_for([4, 6], [[(1, 4)], [(1, 7)]]) is None  # a row writes another slot
    assert part_for([4, 6], [[(1, 4), (1, 9)], [(1, 6)]]) is None  # a checkpoint copy
    assert part_for([None, 6], [[(1, 4)], [(1, 6)]]) is None  # a row starts from zeros


@pytest.mark.parametrize(
    "slots",
    [
        [23, 247, 254, 261, 268],  # shared prefix: the first request prefilled alone
        [9, 2, 4, 6, 30, 31],  # three runs, one of them a lone row
        [5, 1, 12, 3],  # a two-row run of step 11 between lone rows
    ],
)
def test_slot_runs_in_place_decode_matches_gather_path_bit_for_bit(monkeypatch, slots):
    """Slots in a few progressions: the per-run in-place update gives exactly the
    gather / scatter path's outputs and slots (`torch.equal`, NaN slots untouched), and
    matches the reference loop."""
    layer, batch, x, conv, ssm = slots_case(len(slots), slots)
    (part,) = state_parts(batch, "s")
    assert part.slot_runs is not None and len(part.slot_runs) > 1  # the path under test
    assert_batched_equals_reference(layer, batch, x, conv.clone(), ssm.clone())
    fast = StateCache(conv.clone(), ssm.clone(), "s")
    got = layer.forward(x, batch, fast, batched=True)
    monkeypatch.setattr(state_batched, "MAX_SLOT_RUNS", 0)  # every step gathers
    _, plain_batch, _, _, _ = slots_case(len(slots), slots)
    (plain_part,) = state_parts(plain_batch, "s")
    assert plain_part.slot_runs is None
    plain = StateCache(conv.clone(), ssm.clone(), "s")
    want = layer.forward(x, plain_batch, plain, batched=True)
    assert torch.equal(got, want)
    assert torch.equal(fast.ssm.nan_to_num(7.0), plain.ssm.nan_to_num(7.0))
    assert torch.equal(fast.conv.nan_to_num(7.0), plain.conv.nan_to_num(7.0))
    untouched = [s for s in range(ssm.shape[0]) if s not in slots]
    assert fast.ssm[untouched].isnan().all()


def test_slot_runs_split_greedily_and_give_up_past_the_limit():
    def runs_for(reads, writes=None):
        writes = writes if writes is not None else [[(1, r)] for r in reads]
        batch = make_batch(
            [([1], 5) for _ in reads],
            state_slots={"s": StateSlots.from_points(reads, writes)},
        )
        (part,) = state_parts(batch, "s")
        return part.slot_runs

    # greedy: the first two rows make a run of step 224, the rest one of step 7
    assert runs_for([23, 247, 254, 261]) == (SlotRun(0, 2, 23, 224), SlotRun(2, 2, 254, 7))
    assert runs_for([9, 2, 4, 6, 30, 31]) == (
        SlotRun(0, 1, 9, 1),
        SlotRun(1, 3, 2, 2),
        SlotRun(4, 2, 30, 1),
    )
    assert runs_for([4, 6, 9]) == (SlotRun(0, 2, 4, 2), SlotRun(2, 1, 9, 1))
    assert runs_for([8, 6, 4, 2]) == tuple(SlotRun(r, 1, s, 1) for r, s in enumerate([8, 6, 4, 2]))
    assert runs_for([9, 7, 5, 3, 1]) is None  # five one-row runs: past MAX_SLOT_RUNS = 4
    assert runs_for([4, 4]) is None  # two rows on one slot
    assert runs_for([4, 6], [[(1, 4)], [(1, 7)]]) is None  # a row writes another slot


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_kernel_with_scratch_buffer_is_bit_identical(seed):
    """The products written into a reused buffer strided as the state (`engine.ops.scratch`)
    give exactly the fresh-tensor results: outputs and updated states, `torch.equal`."""
    gen = torch.Generator().manual_seed(seed)
    rows, heads, dk, dv = 6, 8, 64, 64
    q, k = (torch.randn(rows, 1, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(rows, 1, heads, dv, generator=gen)
    g, beta = -torch.rand(rows, 1, heads, generator=gen), torch.rand(rows, 1, heads, generator=gen)
    stored = torch.randn(rows, heads, dv, dk, generator=gen) * 0.3
    qp, kp, vp, gp, bp = delta_rule.prepare(q, k, v, g, beta)
    plain_state, scratch_state = stored.clone(), stored.clone()
    want = delta_rule.delta_rule_decode_(qp, kp, vp, gp, bp, plain_state)
    buffers = Scratch()
    work = buffers.take("w", tuple(stored.shape), torch.float32, stored.device)
    work.fill_(float("nan"))  # stale contents must not matter
    got = delta_rule.delta_rule_decode_(qp, kp, vp, gp, bp, scratch_state, work.transpose(-1, -2))
    assert torch.equal(got, want)
    assert torch.equal(scratch_state, plain_state)


def test_scratch_reuses_and_grows_its_buffers():
    buffers = Scratch()
    a = buffers.take("k", (4, 8), torch.float32, torch.device("cpu"))
    b = buffers.take("k", (3, 8), torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and b.shape == (3, 8)  # reused, not reallocated
    c = buffers.take("k", (40, 8), torch.float32, torch.device("cpu"))
    assert c.shape == (40, 8) and c.is_contiguous()  # grown
    assert buffers.take("v", (4, 8), torch.float32, torch.device("cpu")).data_ptr() != (
        c.data_ptr()
    )  # names do not share
    assert buffers.num_bytes() >= (40 + 4) * 8 * 4


def test_kv_block_gather_into_scratch_equals_fresh_gather():
    gen = torch.Generator().manual_seed(3)
    pages = torch.randn(12, 4, 2, 8, generator=gen)
    blocks = torch.tensor([[3, 5, 5], [7, 1, 2]])
    pad = (torch.tensor([0, 0]), torch.tensor([9, 10]))
    fresh = kv_quant.load_blocks(pages, blocks, 11, pad, torch.float32, None)
    out = torch.full((6, 4, 2, 8), float("nan"))
    reused = kv_quant.load_blocks(pages, blocks, 11, pad, torch.float32, None, out=out)
    assert torch.equal(fresh, reused)
    assert not pages.isnan().any()  # the pad zeroing touched the copy only
