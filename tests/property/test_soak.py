"""Soak: long simulator runs with random drafts and forced preemptions end with every
block free and no invariant broken (fast ~5K-step variant; 100K steps with -m slow)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.sched import config_from_plan
from hybridkv.sim import SchedulerConfig, generate_workload, simulate, workload_options

MIX = [ToyGroup("sliding", 4, 16), ToyGroup("full", 4), ToyGroup("state", 8)]


def _soak(num_requests: int, *, seed: int, check_every: int):
    """Small pool (preemptions), few shared prefixes (hits and evictions), K = 6."""
    plan = toy_plan(MIX, num_blocks=120, num_spec_tokens=6)
    trace = generate_workload(
        "suffix",
        workload_options(
            "suffix",
            num_requests=num_requests,
            seed=seed,
            max_drafts=6,
            num_prefixes=6,
            prefix_len=(16, 96),
            suffix_len=(1, 40),
            output_len=(16, 160),
            rate_per_s=400.0,
        ),
    )
    config = config_from_plan(plan, max_num_seqs=6, max_num_batched_tokens=256)
    return simulate(trace, plan, config=config, check_every=check_every, record_usage=False)


def _assert_clean(result, min_steps: int) -> None:
    assert result.steps >= min_steps
    assert result.num_finished == result.num_requests
    assert result.leaked_blocks == 0
    assert result.preemptions > 0
    assert result.prefix_hit_tokens > 0
    assert result.drafts_proposed > result.drafts_accepted > 0


def test_soak_fast() -> None:
    _assert_clean(_soak(400, seed=11, check_every=5), min_steps=5_000)


@pytest.mark.slow
def test_soak_100k_steps() -> None:
    _assert_clean(_soak(7500, seed=12, check_every=50), min_steps=100_000)


@settings(max_examples=25)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(120, 400),  # the longest request (~170 tokens) fits alone
    layout=st.sampled_from(["shared", "split"]),
    k=st.integers(1, 5),
    mix=st.sampled_from(
        [
            (ToyGroup("full", 4),),
            (ToyGroup("full", 2), ToyGroup("state", 8)),
            (ToyGroup("sliding", 4, 12), ToyGroup("state", 4)),
            (ToyGroup("chunked", 4, 16), ToyGroup("mla", 4), ToyGroup("state", 8)),
        ]
    ),
    budget=st.integers(8, 128),
)
def test_random_plans_and_traces_finish_clean(seed, num_blocks, layout, k, mix, budget) -> None:
    plan = toy_plan(list(mix), num_blocks=num_blocks, num_spec_tokens=k, layout=layout)
    trace = generate_workload(
        "chat",
        workload_options(
            "chat",
            num_requests=12,
            seed=seed,
            max_drafts=k + 2,
            prefix_len=(8, 48),
            suffix_len=(1, 16),
            output_len=(1, 24),
            max_turns=3,
            rate_per_s=100.0,
        ),
    )
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_spec_tokens=k,
        chunk_align_tokens=plan.hit_granularity_tokens,
    )
    result = simulate(trace, plan, config=config, check_every=1)
    assert result.num_finished == 12 and result.leaked_blocks == 0
