"""The scheduler's per-step block-table deltas rebuild the manager's tables exactly:
random workloads on toy plans (full attention, a sliding window, a state group; a pool
small enough to preempt; shared prefixes for hits; drafts offered 0..K+2 and accepted
at random, so reservations shrink and grow; cancellations between steps). After every
schedule, rows built only from ``released`` + ``deltas`` -- host lists, and the engine's
device tables (`DeviceBlockTables`) -- equal `CacheManager.block_table` for every
scheduled request, and no row is left for a request that is not running."""

from __future__ import annotations

import random

import pytest

from hybridkv.cache import NULL_BLOCK, CacheManager
from hybridkv.cache.toy import ToyGroup, toy_plan
from hybridkv.sched import Request, Scheduler, SchedulerConfig, SchedulerOutput, Status, StepResult

torch = pytest.importorskip("torch")

from hybridkv.engine.forward.block_tables import DeviceBlockTables  # noqa: E402

K = 3
GROUPS = [ToyGroup("full", 4), ToyGroup("sliding", 4, 6), ToyGroup("state", 8)]
PREFIXES = (list(range(1, 41)), [7] * 24)


def apply_host(rows: dict[tuple[str, int], list[int]], out: SchedulerOutput) -> None:
    """The reference: `GroupDelta.apply` on plain lists."""
    for req_id in out.released:
        for key in [k for k in rows if k[0] == req_id]:
            del rows[key]
    for req_id, delta in out.deltas.items():
        for group_id, group_delta in delta.groups.items():
            if delta.admitted:
                rows[req_id, group_id] = []
            group_delta.apply(rows.setdefault((req_id, group_id), []), NULL_BLOCK)


def run(seed: int, num_steps: int = 150) -> dict[str, int]:
    rng = random.Random(seed)
    plan = toy_plan(GROUPS, num_blocks=rng.choice([40, 60, 90]), num_spec_tokens=K)
    manager = CacheManager(plan)
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=rng.choice([16, 32, 64]),
        chunk_size=rng.choice([None, 8]),
        max_spec_tokens=K,
    )
    s = Scheduler(manager, config)
    host: dict[tuple[str, int], list[int]] = {}
    device = DeviceBlockTables.for_plan(plan, torch.device("cpu"))
    attention = [g.group_id for g in plan.groups if not g.is_state]
    seen = {"preempted": 0, "dropped": 0, "hits": 0, "cancelled": 0, "nulled": 0, "drafts": 0}
    live: list[Request] = []
    count = 0
    for _ in range(num_steps):
        if rng.random() < 0.3 or not s.has_work:
            prefix = rng.choice(PREFIXES)[: rng.randrange(4, 40)]
            prompt = prefix + [rng.randrange(200, 260) for _ in range(rng.randrange(0, 6))]
            req = Request(f"r{count}", prompt, rng.randrange(1, 12))
            count += 1
            if s.add(req):
                live.append(req)
        if rng.random() < 0.08:
            active = [r for r in live if r.status in (Status.WAITING, Status.RUNNING)]
            if active:
                s.cancel(rng.choice(active))
                seen["cancelled"] += 1
        if not s.has_work:
            continue
        offered = {r.req_id: rng.randrange(0, K + 3) for r in s.decode_ready()}
        out = s.schedule(offered)
        apply_host(host, out)
        device.apply_step(out.released, out.deltas)
        for chunk in out.chunks:
            req_id = chunk.request.req_id
            for g in attention:
                held = [int(b) for b in manager.block_table(req_id, g)]
                assert host[req_id, g] == held, (seed, out.step, req_id, g)
                assert device.groups[g].host[req_id] == held
                assert device.table(g, [req_id]).block_ids[0, : len(held)].tolist() == held
        running = {r.req_id for r in s.running}
        assert {k[0] for k in host} <= running, (seed, out.step)
        for g in attention:
            assert set(device.groups[g].rows) <= running
        device.check_invariants()
        seen["preempted"] += len(out.preempted)
        seen["dropped"] += len(out.dropped_drafts)
        seen["hits"] += sum(bool(c.prefix_hit) for c in out.chunks)
        seen["drafts"] += sum(c.num_lookahead for c in out.chunks)
        seen["nulled"] += sum(
            bool(d.nulled_range) for step in out.deltas.values() for d in step.groups.values()
        )
        results = {}
        for c in out.chunks:
            if c.samples:
                a = rng.randrange(0, c.num_lookahead + 1)
                results[c.request.req_id] = StepResult(
                    a, [rng.randrange(300, 320) for _ in range(a + 1)]
                )
        s.update(out, results)
        s.check_invariants()
        manager.check_invariants()
    return seen


@pytest.mark.parametrize("seed", range(12))
def test_deltas_rebuild_the_managers_tables(seed):
    run(seed)


def test_the_workloads_exercise_every_kind_of_change():
    """Across the seeds above: preemptions, global draft drops, prefix hits,
    cancellations, sliding-window nulls and drafts all happen (else the test above
    proves less than it says)."""
    total: dict[str, int] = {}
    for seed in range(12):
        for key, value in run(seed).items():
            total[key] = total.get(key, 0) + value
    assert all(total[key] > 0 for key in total), total
