"""Workload generators: deterministic per seed, valid traces, the promised draft shapes."""

from __future__ import annotations

import itertools

import pytest

from hybridkv.sim.trace import iter_trace_lines, parse_trace
from hybridkv.sim.workloads import WORKLOADS, generate_workload, workload_options

SMALL = {"prefix_len": (64, 256), "suffix_len": (8, 64), "output_len": (8, 96)}


@pytest.mark.parametrize("kind", sorted(WORKLOADS))
def test_same_seed_same_trace_other_seed_other_trace(kind: str) -> None:
    def make(seed: int):
        return generate_workload(
            kind, workload_options(kind, num_requests=25, seed=seed, max_drafts=5, **SMALL)
        )

    first, again, other = make(3), make(3), make(4)
    assert first == again
    assert first != other
    assert len(first) == 25


@pytest.mark.parametrize("kind", sorted(WORKLOADS))
def test_generated_trace_parses_back_and_respects_k(kind: str) -> None:
    requests = generate_workload(
        kind, workload_options(kind, num_requests=30, seed=1, max_drafts=4, **SMALL)
    )
    assert parse_trace(iter_trace_lines(requests)) == requests
    for req in requests:
        assert req.spec is not None
        assert all(0 <= acc <= prop <= 4 for prop, acc in req.spec)
        assert req.arrival_s >= 0


def test_suffix_drafts_jump_between_zero_and_k() -> None:
    requests = generate_workload(
        "suffix", workload_options("suffix", num_requests=20, seed=0, max_drafts=16, **SMALL)
    )
    proposed = [prop for req in requests for prop, _ in req.spec or ()]
    assert 0 in proposed and 16 in proposed
    jumps = sum(1 for a, b in itertools.pairwise(proposed) if abs(a - b) >= 8)
    assert jumps >= len(proposed) // 10


def test_chat_turns_extend_the_previous_turn() -> None:
    requests = generate_workload(
        "chat", workload_options("chat", num_requests=40, seed=2, max_turns=4, **SMALL)
    )
    by_id = {req.id: req for req in requests}
    extended = 0
    for req in requests:
        conv, _, turn = req.id.rpartition("-t")
        if int(turn) > 0:
            prev = by_id[f"{conv}-t{int(turn) - 1}"]
            assert req.prompt[: len(prev.prompt) + len(prev.output)] == prev.prompt + prev.output
            assert req.arrival_s > prev.arrival_s
            extended += 1
    assert extended > 0


def test_no_drafts_means_no_spec_and_bad_kind_is_rejected() -> None:
    requests = generate_workload("documents", workload_options("documents", num_requests=3))
    assert all(req.spec is None for req in requests)
    with pytest.raises(ValueError, match="unknown workload kind"):
        workload_options("poetry")
    with pytest.raises(ValueError, match="low <= high"):
        generate_workload("chat", workload_options("chat", output_len=(5, 2)))


def test_roundrobin_serves_every_session_in_turn_and_grows_each_session() -> None:
    opts = workload_options("roundrobin", num_sessions=3, max_turns=2, num_requests=6, **SMALL)
    requests = generate_workload("roundrobin", opts)
    assert [r.id for r in requests] == ["rr0-t0", "rr1-t0", "rr2-t0", "rr0-t1", "rr1-t1", "rr2-t1"]
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    for first, second in zip(requests[:3], requests[3:], strict=True):
        seen = list(first.prompt) + list(first.output)
        assert list(second.prompt[: len(seen)]) == seen and len(second.prompt) > len(seen)


def test_reuse_bound_counts_the_longest_earlier_prefix_token_exact() -> None:
    from hybridkv.sim.reuse import reuse_bound_rate, reuse_bound_tokens
    from hybridkv.sim.trace import TraceRequest

    def req(i: str, t: float, prompt: list[int], output: list[int], salt=None) -> TraceRequest:
        return TraceRequest(
            id=i, arrival_s=t, prompt=tuple(prompt), output=tuple(output), cache_salt=salt
        )

    trace = [
        req("b", 1.0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0]),  # a's prompt + output + more
        req("a", 0.0, [1, 2, 3, 4, 5, 6], [7, 8]),
        req("c", 2.0, [1, 2, 3], [4]),  # capped at len - 1
        req("d", 3.0, [1, 2, 3, 4, 5, 6], [0], salt="other"),  # another tenant: nothing
        req("e", 4.0, [9, 9], [9]),
    ]
    assert reuse_bound_tokens(trace) == [8, 0, 2, 0, 0]
    assert reuse_bound_rate(trace) == 10 / 27
