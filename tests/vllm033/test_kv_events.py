"""KV-cache events of `hybridkv.vllm.Scheduler` under vLLM 0.33 (no kernels, no weights):
vLLM's own `Request`s and block hasher, its event classes, its scheduler publishing.

A router that knows only the events and vLLM 0.33's hashing (`tests.kv_event_index`)
predicts every prefix hit on the hybrid layout (full attention + a Mamba group in align
mode): multi-turn sessions sharing a system prompt that ends inside a block, in a pool
small enough to evict. The scheduler is driven as in `test_hybridkv_scheduler`.

    VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest -m vllm tests/vllm033
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.kv_event_index import EventIndex
from tests.vllm033.test_hybridkv_scheduler import (  # noqa: F401 (model_dir: a fixture)
    BLOCK_SIZE,
    Worker,
    build_scheduler,
    make_request,
    model_dir,
    run_to_end,
)

pytestmark = pytest.mark.vllm


def _scheduler_with_events(folder: Path, num_blocks: int, monkeypatch: Any) -> Any:
    """`build_scheduler` with ``--kv-events-config`` on: vLLM's ZMQ publisher on an
    in-process endpoint (the test reads each batch as the scheduler publishes it)."""
    from vllm.config import KVEventsConfig

    import hybridkv.vllm

    events = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"inproc://hkv-{num_blocks}"
    )

    class WithEvents(hybridkv.vllm.Scheduler):  # type: ignore[misc, name-defined]
        def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            vllm_config.kv_events_config = events  # as --kv-events-config sets it
            super().__init__(vllm_config, *args, **kwargs)

    monkeypatch.setattr(hybridkv.vllm, "Scheduler", WithEvents)
    return build_scheduler(folder, "hybrid", num_blocks=num_blocks)


def _index() -> EventIndex:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    def tail(parent: bytes | None, tokens: Any) -> bytes:
        return bytes(kv_cache_utils.hash_block_tokens(sha256, parent, list(tokens), None))

    def chain(prompt: Any) -> list[bytes]:
        out: list[bytes] = []
        for start in range(0, len(prompt) // BLOCK_SIZE * BLOCK_SIZE, BLOCK_SIZE):
            out.append(tail(out[-1] if out else None, prompt[start : start + BLOCK_SIZE]))
        return out

    groups = [
        {"group_idx": 0, "kind": "full_attention", "block_size": BLOCK_SIZE},
        {"group_idx": 1, "kind": "mamba", "block_size": BLOCK_SIZE},
    ]
    return EventIndex(groups, BLOCK_SIZE, chain, tail, kv_cache_utils.maybe_convert_block_hash)


@pytest.mark.parametrize("num_blocks", [400, 24])
def test_router_predicts_every_hit(
    model_dir: Path,  # noqa: F811 (the fixture imported above)
    monkeypatch: Any,
    num_blocks: int,
) -> None:
    from hybridkv.vllm.harness import EventTap

    scheduler = _scheduler_with_events(model_dir, num_blocks, monkeypatch)
    assert scheduler.hybridkv_active and scheduler.kv_cache_manager.events is not None
    tap = EventTap(scheduler)
    reported: dict[str, int] = {}  # the hit vLLM reports (its outputs' prefill stats)
    update = scheduler.update_from_output

    def reporting_update(*args: Any) -> Any:
        engine_outputs = update(*args)
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                if output.prefill_stats is not None:
                    reported[output.request_id] = output.prefill_stats.num_cached_tokens
        return engine_outputs

    scheduler.update_from_output = reporting_update
    worker = Worker()
    rng = random.Random(num_blocks)
    system = [rng.randrange(3, 900) for _ in range(40)]  # ends inside the third block
    contexts = [
        system + [rng.randrange(3, 900) for _ in range(rng.randrange(5, 30))] for _ in range(4)
    ]
    requests: dict[str, Any] = {}
    for turn in range(3):
        for i, context in enumerate(contexts):
            request = make_request(f"s{i}t{turn}", context, max_tokens=rng.randrange(3, 12))
            requests[request.request_id] = request
            scheduler.add_request(request)
        outputs = run_to_end(scheduler, worker, "hybrid")
        contexts = [
            ctx + outputs[f"s{i}t{turn}"] + [rng.randrange(3, 900) for _ in range(7)]
            for i, ctx in enumerate(contexts)
        ]
    # finished requests were freed (their last steps committed) inside update_from_output:
    # one more step publishes nothing new
    scheduler.update_from_output(scheduler.schedule(), _empty_output())
    scheduler.shutdown()

    events = [e for _, batch, *rank in tap.batches for e in batch]
    assert {rank[0] for _, _, *rank in tap.batches} == {0}  # stamped by the publisher
    assert len(events) == tap.num_taken
    index, applied, predictions = _index(), 0, []
    for req_id, num_before, hit, tokens in tap.lookups:
        while applied < num_before:
            index.apply(events[applied])
            applied += 1
        predictions.append(index.predict(tokens))
        assert predictions[-1] == hit, (req_id, predictions[-1], hit)
    for req_id, at in tap.admitted.items():
        assert predictions[at] == reported[req_id], req_id
    for event in events[applied:]:
        index.apply(event)
    kinds = {e["type"] for e in events}
    assert len(reported) == len(requests) == len(tap.admitted)
    assert sum(reported.values()) > 0
    assert "BlockStored" in kinds
    assert "BlockRemoved" in kinds  # turn-end entries taken over, and evictions:
    assert (scheduler.kv_cache_manager.cache.stats().num_evictions > 0) == (num_blocks == 24)
    off_boundary = sum(1 for hit in reported.values() if hit % BLOCK_SIZE)
    print(
        f"\nvLLM 0.33, {num_blocks} blocks: {len(events)} events, {len(tap.lookups)} lookups "
        f"predicted, {len(reported)} requests, {sum(reported.values())} hit tokens reported "
        f"= predicted ({off_boundary} hits inside a block)"
    )
    tails = [e for e in events if e["type"] == "BlockStored" and e["block_size"] != BLOCK_SIZE]
    assert tails and all(e["group_idx"] in (0, 1) for e in tails)  # turn ends
    for event in events:
        if event["type"] == "BlockStored":
            assert len(event["token_ids"]) == len(event["block_hashes"]) * event["block_size"]
            assert event["kv_cache_spec_kind"] == ("full_attention", "mamba")[event["group_idx"]]


def _empty_output() -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
