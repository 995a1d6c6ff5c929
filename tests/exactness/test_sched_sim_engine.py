"""The simulator and the engine make the same decisions on the same trace, step by step:
run the engine (tiny random-weight hybrid, greedy, with and without speculation, a pool
small enough to preempt), record its requests as a trace (prompt, output, per decode
step [proposed, accepted]), replay it through `simulate` with the same plan and
scheduler limits, and compare every step's schedule (drafts dropped to fit included).
The engine checks its delta-fed block tables against the manager's rows every step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine import LLM  # noqa: E402
from hybridkv.sched import SchedulerOutput, StepReport  # noqa: E402
from hybridkv.sim import TraceRequest, simulate  # noqa: E402

NUM_NEW = 24


def signature(output: SchedulerOutput) -> tuple:
    chunks = tuple(
        (
            c.request.req_id,
            c.num_computed,
            c.num_new_tokens,
            c.num_lookahead,
            c.decode,
            c.prefix_hit,
        )
        for c in output.chunks
    )
    preempted = tuple((p.request.req_id, p.num_computed) for p in output.preempted)
    drops = (output.dropped_drafts, output.avoided_preemption)
    return chunks, preempted, output.deferred, drops


def run_engine(llm: LLM, prompts):
    steps: list[tuple] = []
    spec: dict[str, list[tuple[int, int]]] = {}

    def hook(output: SchedulerOutput, report: StepReport) -> None:
        steps.append(signature(output))
        for c in output.chunks:
            if c.decode:
                accepted = report.accepted[c.request.req_id]
                spec.setdefault(c.request.req_id, []).append((c.num_proposed, accepted))

    llm.stepper.hooks.append(hook)
    llm.stepper.check_tables = True  # delta-applied rows == the manager's, every step
    results = llm.generate(prompts, NUM_NEW, ignore_eos=True)
    trace = [
        TraceRequest(
            id=r.request_id,
            arrival_s=0.0,
            prompt=tuple(r.prompt_token_ids),
            output=tuple(r.token_ids),
            spec=tuple(spec.get(r.request_id, ())),
        )
        for r in results
    ]
    return steps, trace


def replay(llm: LLM, trace):
    """The trace under the engine's own scheduler config (one `SchedulerConfig` type)."""
    steps: list[tuple] = []
    result = simulate(
        trace,
        llm.plan,
        config=llm.scheduler.config,
        check_every=1,
        on_step=lambda out, _: steps.append(signature(out)),
    )
    return steps, result


CASES = {
    "plain": dict(chunk_size=5, memory_bytes=98 << 10),
    "ngram": dict(spec_method="ngram", num_spec_tokens=3, chunk_size=4, memory_bytes=150 << 10),
    "draft": dict(draft=True, num_spec_tokens=2, chunk_size=3, memory_bytes=290 << 10),
    # pressure: drafts of earlier requests are dropped so that a later one fits
    "draft_pressure": dict(draft=True, num_spec_tokens=4, chunk_size=4, memory_bytes=300 << 10),
}


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_simulator_and_engine_decide_the_same_steps(llm_case, case_name):
    case = llm_case("qwen3_5")
    kwargs = dict(CASES[case_name])
    if kwargs.pop("draft", False):
        kwargs["draft"] = case.folder
    llm = LLM(case.folder, max_model_len=128, **kwargs)
    engine_steps, trace = run_engine(llm, case.prompts)
    assert [list(t.output[:NUM_NEW]) for t in trace][:1] == [case.expected[0][:NUM_NEW]]
    sim_steps, result = replay(llm, trace)
    assert result.num_finished == len(trace) and result.leaked_blocks == 0
    assert len(sim_steps) == len(engine_steps)
    for i, (sim, engine) in enumerate(zip(sim_steps, engine_steps, strict=True)):
        assert sim == engine, f"step {i} differs"
    # the run exercised what it should: preemption, dedupe, and drafts when speculating
    assert llm.stats().num_preemptions == result.preemptions > 0
    assert any(deferred for _, _, deferred, _ in engine_steps)
    if case_name != "plain":
        assert any(c[3] for chunks, _, _, _ in engine_steps for c in chunks)
    if case_name == "draft_pressure":
        # a step where dropping drafts globally fit everyone, and the rule without
        # planning (a request drops only its own drafts) would have preempted someone
        avoided = [
            (i, drops) for i, (_, preempted, _, drops) in enumerate(engine_steps) if drops[1]
        ]
        assert avoided and all(not engine_steps[i][1] for i, _ in avoided), avoided
        assert llm.scheduler.planner.num_preemptions_avoided == len(avoided)
