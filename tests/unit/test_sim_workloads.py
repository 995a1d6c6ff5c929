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
