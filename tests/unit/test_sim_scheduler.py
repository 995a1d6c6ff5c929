"""Scheduler model on small hand-made plans: everything finishes, nothing leaks, the
invariants hold after every step, and the accounting matches hand-computed numbers."""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv import sched
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.sched import SchedulerOutput, config_from_plan
from hybridkv.sim import (
    ReplayOptions,
    SimulationError,
    TraceRequest,
    generate_workload,
    simulate,
    workload_options,
)
from hybridkv.sim.simulator import build_manager

GROUP_MIXES = {
    "full": [ToyGroup("full", 4)],
    "full+state": [ToyGroup("full", 4), ToyGroup("state", 8)],
    "sliding+full+state": [ToyGroup("sliding", 4, 16), ToyGroup("full", 4), ToyGroup("state", 8)],
    "chunked+mla+state": [ToyGroup("chunked", 4, 32), ToyGroup("mla", 4), ToyGroup("state", 8)],
}


def _trace(kind: str = "chat", num_requests: int = 40, seed: int = 1, max_drafts: int = 4):
    return generate_workload(
        kind,
        workload_options(
            kind,
            num_requests=num_requests,
            seed=seed,
            max_drafts=max_drafts,
            prefix_len=(32, 160),
            suffix_len=(4, 48),
            output_len=(4, 64),
            rate_per_s=20.0,
        ),
    )


@pytest.mark.parametrize("layout", ["shared", "split"])
@pytest.mark.parametrize("num_blocks", [1000, 160])
@pytest.mark.parametrize("mix", sorted(GROUP_MIXES))
def test_every_request_finishes_without_leaks(mix: str, num_blocks: int, layout: str) -> None:
    plan = toy_plan(GROUP_MIXES[mix], num_blocks=num_blocks, num_spec_tokens=4, layout=layout)
    trace = _trace()
    result = simulate(trace, plan, check_every=1)
    assert result.num_finished == result.num_requests == len(trace)
    assert result.leaked_blocks == 0
    assert result.invariant_checks == result.steps + 1
    assert result.output_tokens == sum(len(r.output) for r in trace)
    assert 0 < result.peak_usage <= 1
    assert result.drafts_accepted <= result.drafts_proposed


def test_tight_pool_preempts_and_recovers() -> None:
    plan = toy_plan(GROUP_MIXES["sliding+full+state"], num_blocks=90, num_spec_tokens=4)
    trace = generate_workload(
        "suffix",
        workload_options(
            "suffix",
            num_requests=60,
            seed=5,
            max_drafts=4,
            prefix_len=(32, 160),
            suffix_len=(4, 48),
            output_len=(4, 64),
            rate_per_s=200.0,
        ),
    )
    result = simulate(trace, plan, check_every=1)
    assert result.preemptions > 0
    assert result.num_finished == 60 and result.leaked_blocks == 0


def test_request_that_cannot_step_alone_is_a_typed_error_not_a_livelock() -> None:
    """Alone, a request shrinks its chunk and drops drafts before giving up."""
    plan = toy_plan([ToyGroup("full", 4)], num_blocks=11)  # 10 usable blocks: 40 tokens
    trace = [
        TraceRequest(id="long", arrival_s=0.0, prompt=tuple(range(30)), output=tuple(range(20)))
    ]
    with pytest.raises(SimulationError, match="'long' cannot take its next step alone"):
        simulate(trace, plan)


def test_batched_and_per_request_paths_agree() -> None:
    plan = toy_plan(GROUP_MIXES["full+state"], num_blocks=150, num_spec_tokens=4)
    trace = _trace(num_requests=50, seed=7)
    batched = simulate(trace, plan, batched=True).to_dict()
    single = simulate(trace, plan, batched=False).to_dict()
    for key in (
        "steps",
        "prefix_hit_tokens",
        "preemptions",
        "output_tokens",
        "state_checkpoints_stored",
        "drafts_accepted",
    ):
        assert batched[key] == single[key], key


@pytest.mark.parametrize("rules", [("turn_end",), None])
def test_shared_prefix_hit_tokens_are_exact(rules) -> None:
    """Second request arrives after the first finished: it hits the first's full blocks
    of the shared 10 tokens (block 4: 8 tokens), nothing from the differing tail, with
    or without the junction rule: on an attention-only plan the rule (and with it
    junction copies, `hybridkv.cache.junction`) is off; tests/unit/test_junction_copy.py
    covers copies in a plan with a state group."""
    hit = 8
    shared = tuple(range(100, 110))
    trace = [
        TraceRequest(id="a", arrival_s=0.0, prompt=(*shared, 1, 2), output=(7, 8)),
        TraceRequest(id="b", arrival_s=5.0, prompt=(*shared, 3, 4, 5), output=(9,)),
    ]
    the_plan = toy_plan([ToyGroup("full", 4)], num_blocks=64)
    manager = build_manager(the_plan, checkpoint_rules=rules)
    result = simulate(trace, the_plan, manager=manager)
    assert result.prefix_hit_tokens == hit
    assert result.prompt_tokens == 25
    assert result.prefix_hit_rate == pytest.approx(hit / 25)
    assert result.leaked_blocks == 0


def test_drafts_follow_the_trace_and_are_capped_by_the_plan() -> None:
    trace = [
        TraceRequest(
            id="a",
            arrival_s=0.0,
            prompt=tuple(range(1, 6)),
            output=tuple(range(20, 32)),
            spec=((6, 6), (3, 1), (0, 0), (5, 2)),
        )
    ]
    capped = simulate(
        trace, toy_plan([ToyGroup("full", 4), ToyGroup("state", 4)], num_spec_tokens=4)
    )
    # steps: prefill emits 1; (6->4 capped, 4 accepted) 5; (3,1) 2; (0,0) 1; then 3
    # tokens are left, so (5->2: drafts never pass max_new_tokens, 2 accepted) 3
    assert capped.drafts_proposed == 4 + 3 + 0 + 2
    assert capped.drafts_accepted == 4 + 1 + 0 + 2
    none = simulate(trace, toy_plan([ToyGroup("full", 4)]))  # no spec method: no drafts
    assert none.drafts_proposed == 0 and none.num_finished == 1


def test_request_too_large_for_the_pool_is_a_typed_error() -> None:
    trace = [TraceRequest(id="big", arrival_s=0.0, prompt=tuple(range(200)), output=(1, 2))]
    with pytest.raises(SimulationError, match="'big'"):
        simulate(trace, toy_plan([ToyGroup("full", 4)], num_blocks=20))


def test_chunks_respect_the_token_budget_and_align_for_checkpoints() -> None:
    plan = toy_plan([ToyGroup("full", 4), ToyGroup("state", 16)], num_blocks=400)
    config = config_from_plan(plan, max_num_batched_tokens=40)
    assert config.chunk_align_tokens == plan.hit_granularity_tokens == 16
    trace = [
        TraceRequest(id="a", arrival_s=0.0, prompt=tuple(range(1, 101)), output=(1,)),
        TraceRequest(id="b", arrival_s=9.0, prompt=tuple(range(1, 101)), output=(2,)),
    ]
    result = simulate(trace, plan, config=config, check_every=1)
    # a: chunks 0-32, 32-64, 64-96, 96-100 -> checkpoints at 32, 64, 96; b hits 96
    assert result.prefix_hit_tokens == 96
    assert result.leaked_blocks == 0
    unaligned = simulate(trace, plan, config=dataclasses.replace(config, chunk_align_tokens=0))
    assert unaligned.prefix_hit_tokens < 96  # 0-40, 40-80, 80-100: fewer boundaries hit


def test_max_steps_stops_early_and_reports_unknown_leaks() -> None:
    plan = toy_plan([ToyGroup("full", 4)], num_blocks=4000)
    result = simulate(_trace(num_requests=30), plan, max_steps=5)
    assert result.steps == 5 and result.num_finished < 30
    assert result.leaked_blocks == -1


def test_one_scheduler_config_for_engine_and_simulator() -> None:
    """The simulator runs the scheduler's own config type; its run switches are apart."""
    import hybridkv.sim

    assert hybridkv.sim.SchedulerConfig is sched.SchedulerConfig
    plan = toy_plan([ToyGroup("full", 4)], num_blocks=40)
    trace = [TraceRequest(id="a", arrival_s=0.0, prompt=tuple(range(1, 20)), output=(1, 2))]
    config = config_from_plan(plan, max_num_batched_tokens=8, chunk_size=5)
    seen: list[int] = []

    def record(output: SchedulerOutput, _: object) -> None:
        seen.append(output.num_scheduled_tokens)

    simulate(trace, plan, config=config, on_step=record)
    assert max(seen) == 5  # the config's chunk_size, not the plan's budget


@pytest.mark.parametrize(
    ("options", "match"),
    [(dict(check_every=-1), "check_every=-1: needs >= 0"), (dict(max_steps=0), "max_steps=0")],
)
def test_replay_options_refuse_bad_numbers(options: dict[str, int], match: str) -> None:
    with pytest.raises(SimulationError, match=match):
        ReplayOptions(**options)
