"""Belady's MIN in the simulator (`hybridkv.sim.belady`): exact hits on a hand-made
trace, and never below LRU on random traces."""

from __future__ import annotations

import random

import pytest

from hybridkv.errors import PlanError
from hybridkv.plan import plan
from hybridkv.plan.types import CachePlan
from hybridkv.sim import simulate
from hybridkv.sim.belady import belady_manager
from hybridkv.sim.trace import TraceRequest
from hybridkv.spec import AttentionSpec, ModelSpec

BLOCK = 16


def _plan(usable_blocks: int) -> CachePlan:
    """One full-attention layer, block 16, a pool of exactly ``usable_blocks``."""
    model = ModelSpec(
        name="tiny",
        model_type="t",
        layers=(AttentionSpec(num_kv_heads=1, head_dim=8),),
        max_position_embeddings=4096,
    )
    for memory in range(1 << 10, 1 << 20, 64):
        try:
            the_plan = plan(
                model, None, memory_bytes=memory, max_model_len=64, block_size=BLOCK, max_num_seqs=1
            )
        except PlanError:  # too small for one request
            continue
        if the_plan.pools[0].num_pages - 1 == usable_blocks:
            return the_plan
    raise AssertionError(f"no memory gives {usable_blocks} blocks")


def _request(i: int, prefix: int, suffix: int = 1) -> TraceRequest:
    """A prompt of one full block (tokens named by ``prefix``) plus ``suffix`` unique
    tokens; one output token. Only the full block is ever cached."""
    prompt = tuple(1000 * (prefix + 1) + j for j in range(BLOCK)) + tuple(
        10**6 + 100 * i + j for j in range(suffix)
    )
    return TraceRequest(id=f"r{i}", arrival_s=10.0 * i, prompt=prompt, output=(7,))


def test_belady_hits_on_a_cyclic_trace_match_the_hand_count() -> None:
    # Pool of 4 blocks. A request holds 2 blocks while it runs (its prefix block and the
    # block of its 17th token and output) and leaves its prefix block cached. Prefixes
    # A B C D E A B C D E:
    #   t0-t2 A B C miss, cached {A,B,C}, one fresh block left
    #   t3 D miss: fresh + evict the block used last (C at t7): cached {A,B,D}
    #   t4 E miss: evict D (t8, later than A t5, B t6): cached {A,B,E}
    #   t5 A hit, t6 B hit (one fresh block each)
    #   t7 C miss, t8 D miss: evict A, B (never used again), keep E (t9)
    #   t9 E hit
    # -> 3 hits of 16 tokens over 10 prompts of 17 tokens. LRU evicts each block just
    # before its turn: no hit.
    trace = [_request(i, i % 5) for i in range(10)]
    the_plan = _plan(4)
    belady = simulate(trace, the_plan, manager=belady_manager(the_plan, trace, checkpoint_rules=()))
    lru = simulate(trace, the_plan, eviction_policy="lru", checkpoint_rules=())
    assert belady.prefix_hit_rate == pytest.approx(3 * BLOCK / (10 * (BLOCK + 1)))
    assert lru.prefix_hit_rate == 0.0
    assert belady.leaked_blocks == lru.leaked_blocks == 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_belady_never_below_lru_on_random_traces(seed: int) -> None:
    rng = random.Random(seed)
    trace = [_request(i, rng.randrange(6), rng.randrange(1, 20)) for i in range(60)]
    the_plan = _plan(rng.choice([4, 5, 6]))
    manager = belady_manager(the_plan, trace, checkpoint_rules=())
    belady = simulate(trace, the_plan, manager=manager, check_every=1)
    for policy in ("lru", "chain"):
        other = simulate(trace, the_plan, eviction_policy=policy, checkpoint_rules=())
        assert belady.prefix_hit_rate >= other.prefix_hit_rate, (policy, seed)
    assert belady.leaked_blocks == 0
