"""`hybridkv.vllm.Scheduler` with vLLM 0.33's async scheduling on, driven the way vLLM's
engine core drives it (``EngineCore.step_with_batch_queue``, vllm/v1/engine/core.py
0.33:708-822: a batch queue of 2): schedule ``k + 1`` before step ``k``'s output is
processed, so every decode step is scheduled with the token the step before samples
still a placeholder. The fake worker of `test_hybridkv_scheduler` holds the rows; every
step is checked against the manager, and the outputs must equal a synchronous run's.

Runs only in vLLM 0.33's venv::

    VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest -m vllm tests/vllm033
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from tests.vllm033.test_hybridkv_scheduler import (
    BLOCK_SIZE,
    Worker,
    build_scheduler,
    check_drained,
    check_step,
    make_request,
    model_dir,  # noqa: F401  (the fixture)
    run_to_end,
)

pytestmark = pytest.mark.vllm


def accept(req_id: str, num_output_tokens: int, num_drafts: int) -> int:
    """Drafts the fake worker accepts: a function of where the request stands, so a
    synchronous and an async run accept the same at the same token."""
    return (int(req_id[1:]) * 7 + num_output_tokens * 3) % (num_drafts + 1)


def drafts_of(num_drafts: int) -> list[int]:
    """The drafter's tokens (as `test_hybridkv_scheduler.propose` proposes them)."""
    return [7 + i for i in range(num_drafts)]


def sample(req_id: str, request: Any, num_drafts: int) -> list[int]:
    """The accepted drafts and the token after them."""
    num_output = len(request.output_token_ids)
    accepted = accept(req_id, num_output, num_drafts)
    return [*drafts_of(accepted), 100 + num_output % 800]


def _answer(scheduler: Any, out: Any, samples: set[str]) -> None:
    """vLLM's worker's output for ``out``: for each request in ``samples`` (decided
    when the step was scheduled: its tokens reached the request's end) its accepted
    drafts and one token more; the drafts are the worker's own (the scheduler holds
    placeholders)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        if req_id not in samples or request is None:
            sampled.append([])
            continue
        num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
        sampled.append(sample(req_id, request, num_drafts))
    scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        ),
    )


def run_async(
    scheduler: Any,
    worker: Worker,
    layout: str,
    *,
    abort_at: dict[int, str] | None = None,
    max_steps: int = 2000,
) -> dict[str, list[int]]:
    """Schedule with one step in flight until no request is left; ``abort_at``: step ->
    request aborted after that schedule (its step in flight). Returns every finished
    request's output tokens."""
    from vllm.v1.request import RequestStatus

    queue: deque[tuple[Any, set[str]]] = deque()
    outputs: dict[str, list[int]] = {}
    requests = dict(scheduler.requests)
    for step in itertools.count():
        assert step < max_steps
        if not scheduler.has_unfinished_requests() and not queue:
            break
        if scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            worker.apply(out)
            check_step(scheduler, worker, out, layout)
            samples = {
                r
                for r in out.num_scheduled_tokens
                if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
            }
            queue.append((out, samples))
            victim = (abort_at or {}).get(step)
            if victim is not None and victim in scheduler.requests:
                scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            if len(queue) < 2 and scheduler.has_unfinished_requests():
                continue  # the batch queue has room: schedule again before any output
        _answer(scheduler, *queue.popleft())
    for req_id, request in requests.items():
        outputs[req_id] = list(request.output_token_ids)
    return outputs


def _prompts(n: int, length: int, shared: int = 0) -> list[list[int]]:
    system = [5 + j % 7 for j in range(shared)]
    return [system + [(i * 37 + j) % 900 + 10 for j in range(length)] for i in range(n)]


def test_the_async_form_is_built_and_async_stays_on(
    model_dir: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``--scheduler-cls hybridkv.vllm.Scheduler`` unchanged: with async scheduling on
    the class builds vLLM's async bookkeeping (output placeholders) and keeps async on,
    with drafts too."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from hybridkv.vllm import Scheduler

    scheduler = build_scheduler(model_dir, "hybrid", async_scheduling=True)
    assert isinstance(scheduler, AsyncScheduler) and isinstance(scheduler, Scheduler)
    assert scheduler.hybridkv_active
    assert scheduler.vllm_config.scheduler_config.async_scheduling
    assert scheduler.kv_cache_manager.async_steps
    assert not isinstance(build_scheduler(model_dir, "hybrid"), AsyncScheduler)
    with caplog.at_level(logging.WARNING, logger="vllm.hybridkv"):
        for layout in ("full", "hybrid"):
            spec = build_scheduler(model_dir, layout, num_spec_tokens=3, async_scheduling=True)
            assert spec.hybridkv_active and isinstance(spec, AsyncScheduler)
            assert spec.vllm_config.scheduler_config.async_scheduling
            assert spec.kv_cache_manager.async_steps
    assert "async scheduling turned off" not in caplog.text


@pytest.mark.parametrize("layout", ["full", "sliding", "hybrid"])
def test_async_outputs_equal_sync_and_hits_too(model_dir: Path, layout: str) -> None:  # noqa: F811
    """Six requests sharing a 40-token prefix, chunked prefill (64-token budget), one
    step in flight: the same outputs as the synchronous scheduler, rows checked every
    step, at least the synchronous run's prefix hits, every block back."""
    results = []
    for async_on in (False, True):
        scheduler = build_scheduler(
            model_dir, layout, max_num_batched_tokens=64, async_scheduling=async_on
        )
        for i, prompt in enumerate(_prompts(6, 30 + 0, shared=40)):
            scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=12 + i))
        worker = Worker()
        if async_on:
            outputs = run_async(scheduler, worker, layout)
        else:
            requests = dict(scheduler.requests)
            run_to_end(scheduler, worker, layout)
            outputs = {r: list(q.output_token_ids) for r, q in requests.items()}
        hits = scheduler.kv_cache_manager.cache.stats().num_hit_tokens
        check_drained(scheduler, 200)
        results.append((outputs, hits))
    (sync_out, sync_hits), (async_out, async_hits) = results
    assert async_out == sync_out
    assert all(len(t) == 12 + i for i, t in enumerate(async_out.values()))
    assert sync_hits > 0 and async_hits >= sync_hits


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_async_preemption_and_aborts_with_steps_in_flight(model_dir: Path, layout: str) -> None:  # noqa: F811
    """A 12-block pool (vLLM preempts requests whose step is in flight; their stale
    output is dropped) and two aborts right after a schedule: every other request
    produces all its tokens, rows stay consistent, every block returns."""
    num_blocks = 12
    scheduler = build_scheduler(model_dir, layout, num_blocks=num_blocks, async_scheduling=True)
    worker = Worker()
    for i, prompt in enumerate(_prompts(5, 40)):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=36))
    outputs = run_async(scheduler, worker, layout, abort_at={6: "r1", 40: "r4"})
    assert worker.num_preempted > 0
    finished = {r: t for r, t in outputs.items() if r not in ("r1", "r4")}
    assert all(len(t) == 36 for t in finished.values()), {r: len(t) for r, t in outputs.items()}
    check_drained(scheduler, num_blocks)


def _sync_with_drafts(scheduler: Any, worker: Worker, layout: str, k: int) -> dict[str, list[int]]:
    """The synchronous reference: the drafter proposes ``k`` tokens after every output
    (vLLM's engine core with drafts), the worker accepts as `accept` says."""
    from vllm.v1.outputs import ModelRunnerOutput

    from tests.vllm033.test_hybridkv_scheduler import propose

    requests = dict(scheduler.requests)
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        worker.apply(out)
        check_step(scheduler, worker, out, layout)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            assert list(drafts) == drafts_of(len(drafts))
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])  # a prefill chunk
                continue
            sampled.append(sample(req_id, request, len(drafts)))
        scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
            ),
        )
        propose(scheduler, {r: k for r in scheduler.requests if r in out.num_scheduled_tokens})
    return {r: list(q.output_token_ids) for r, q in requests.items()}


@pytest.mark.parametrize("layout", ["full", "sliding", "hybrid"])
def test_async_with_drafts_outputs_equal_sync(model_dir: Path, layout: str) -> None:  # noqa: F811
    """Drafts (K = 3, 0..3 accepted a step) with one step in flight: every decode step
    is scheduled before the step before reports its accepted count (vLLM schedules it
    as if all were accepted and rolls back at the output); hybridkv holds the blocks of
    the latest start and commits at the real one. The same outputs as the synchronous
    scheduler with the same drafts, rows checked every step, prefix hits, every block
    back."""
    k = 3
    results = []
    for async_on in (False, True):
        scheduler = build_scheduler(
            model_dir,
            layout,
            max_num_batched_tokens=64,
            num_spec_tokens=k,
            async_scheduling=async_on,
        )
        for i, prompt in enumerate(_prompts(6, 30, shared=40)):
            scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=20 + i))
        worker = Worker()
        if async_on:
            outputs = run_async(scheduler, worker, layout)
        else:
            outputs = _sync_with_drafts(scheduler, worker, layout, k)
        hits = scheduler.kv_cache_manager.cache.stats().num_hit_tokens
        check_drained(scheduler, 200)
        results.append((outputs, hits))
    (sync_out, sync_hits), (async_out, async_hits) = results
    assert async_out == sync_out
    assert all(len(t) == 20 + i for i, t in enumerate(async_out.values()))
    assert any(7 in t for t in async_out.values())  # drafts were accepted
    assert sync_hits > 0 and async_hits > 0


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_async_with_drafts_preemption_and_aborts(model_dir: Path, layout: str) -> None:  # noqa: F811
    """Drafts under async scheduling in a 14-block pool (vLLM preempts requests with a
    step ahead in flight) and two aborts right after a schedule: every other request
    produces all its tokens, rows stay consistent, every block returns."""
    num_blocks = 14
    scheduler = build_scheduler(
        model_dir, layout, num_blocks=num_blocks, num_spec_tokens=3, async_scheduling=True
    )
    worker = Worker()
    for i, prompt in enumerate(_prompts(5, 40)):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=36))
    outputs = run_async(scheduler, worker, layout, abort_at={6: "r1", 30: "r4"})
    assert worker.num_preempted > 0
    finished = {r: t for r, t in outputs.items() if r not in ("r1", "r4")}
    assert all(len(t) == 36 for t in finished.values()), {r: len(t) for r, t in outputs.items()}
    check_drained(scheduler, num_blocks)


def chat(
    model_dir: Path,  # noqa: F811
    layout: str,
    async_on: bool,
    k: int = 3,
) -> tuple[list[list[int]], list[list[int]]]:
    """Three turns of six sessions with drafts; each next prompt is the previous turn's
    tokens and three more. Returns each turn's per-session hits at admission and their
    bounds (every token of the session before the turn's new ones)."""
    scheduler = build_scheduler(
        model_dir, layout, max_num_batched_tokens=128, num_spec_tokens=k, async_scheduling=async_on
    )
    worker = Worker()
    manager = scheduler.kv_cache_manager
    admitted: dict[str, int] = {}  # request -> prefix hit at admission
    allocate = manager.allocate_slots

    def spy(request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0, *a: Any, **k: Any):
        first = request.request_id not in manager.ledger.steps and not request.num_computed_tokens
        blocks = allocate(request, num_new_tokens, num_new_computed_tokens, *a, **k)
        if blocks is not None and first:
            admitted.setdefault(request.request_id, num_new_computed_tokens)
        return blocks

    manager.allocate_slots = spy
    contexts = [[5 + (i * 31 + j) % 900 for j in range(40 + 7 * i)] for i in range(6)]
    hits, bounds = [], []
    for turn in range(3):
        bounds.append([len(ctx) - 3 if turn else 0 for ctx in contexts])
        requests = [
            make_request(f"r{10 * turn + i}", ctx, max_tokens=9 + i)
            for i, ctx in enumerate(contexts)
        ]
        for request in requests:
            scheduler.add_request(request)
        if async_on:
            run_async(scheduler, worker, layout)
        else:
            _sync_with_drafts(scheduler, worker, layout, k)
        hits.append([admitted[r.request_id] for r in requests])
        contexts = [
            [*r.prompt_token_ids, *r.output_token_ids, 11 + turn, 12 + turn, 13 + turn]
            for r in requests
        ]
    check_drained(scheduler, 200)
    return hits, bounds


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_async_with_drafts_multi_turn_hits(model_dir: Path, layout: str) -> None:  # noqa: F811
    """Multi-turn chat with drafts: a turn that stops with its next step in flight keeps
    a turn end covering every token where vLLM kept every token the worker sampled (the
    step ahead is committed too), else (tokens dropped at the stop) attention keeps its
    turn end and a state group its last boundary checkpoint. Every later turn hits at
    least its last state boundary; attention-only plans hit at least what the
    synchronous run hits."""
    sync_hits, bounds = chat(model_dir, layout, False)
    async_hits, _ = chat(model_dir, layout, True)
    assert sync_hits[0] == async_hits[0] == [0] * 6
    for turn in (1, 2):
        for sync_hit, async_hit, bound in zip(
            sync_hits[turn], async_hits[turn], bounds[turn], strict=True
        ):
            assert bound // BLOCK_SIZE * BLOCK_SIZE <= async_hit <= bound
            assert async_hit >= sync_hit // BLOCK_SIZE * BLOCK_SIZE
        if layout == "full":
            assert sum(async_hits[turn]) >= sum(sync_hits[turn])
