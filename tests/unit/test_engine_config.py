"""`EngineConfig`: the one record an `LLM` is built from; the keywords are a thin layer
that builds it, and its scheduling limits are the scheduler's own `SchedulerConfig`."""

from __future__ import annotations

import dataclasses
import typing

import pytest

pytest.importorskip("torch")

from hybridkv.demo import DEMO_MAIN
from hybridkv.engine import LLM, EngineConfig, GenerationResult, SamplingParams
from hybridkv.engine.config import (
    ENGINE_SCHEDULER_DEFAULTS,
    PLAN_KEYWORDS,
    SCHEDULER_KEYWORDS,
    EngineKeywords,
)
from hybridkv.errors import EngineError
from hybridkv.sched import SchedulerConfig


def test_every_keyword_has_one_home() -> None:
    """The typed keywords are exactly the config's fields, the scheduling limits and the
    planner options passed through: none is missing, none goes nowhere."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"scheduler", "plan_options"}
    homes = [fields, set(SCHEDULER_KEYWORDS), set(PLAN_KEYWORDS)]
    assert sum(len(h) for h in homes) == len(set().union(*homes)), "a keyword in two homes"
    assert set(typing.get_type_hints(EngineKeywords)) == set().union(*homes)
    assert set(SCHEDULER_KEYWORDS) <= {f.name for f in dataclasses.fields(SchedulerConfig)}


def test_keywords_build_the_config() -> None:
    config = EngineConfig.from_keywords(
        dtype="bfloat16", max_num_seqs=3, chunk_size=7, cache_aware=False, state_mode="all"
    )
    assert config.dtype == "bfloat16"
    assert config.scheduler == dataclasses.replace(
        ENGINE_SCHEDULER_DEFAULTS, max_num_seqs=3, chunk_size=7, cache_aware=False
    )
    assert dict(config.plan_options) == {"state_mode": "all"}
    assert EngineConfig.from_keywords() == EngineConfig()


def test_the_config_is_frozen_and_owns_its_values() -> None:
    options = {"state_mode": "all"}
    config = EngineConfig(plan_options=options, spec_tree=[[0], [0, 0]], checkpoint_rules=["a"])
    options["state_mode"] = "none"
    assert config.plan_options["state_mode"] == "all"
    assert config.spec_tree == ((0,), (0, 0)) and config.checkpoint_rules == ("a",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = "float16"  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.plan_options["tp"] = 2  # type: ignore[index]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: EngineConfig.from_keywords(max_num_seq=3), "unknown keyword 'max_num_seq'"),
        (lambda: EngineConfig(plan_options={"memory_bytes": 1}), "set by the engine"),
        (lambda: EngineConfig(plan_options={"nope": 1}), r"plan_options \['nope'\]"),
        (
            lambda: EngineConfig(scheduler=SchedulerConfig(max_spec_tokens=2)),
            "scheduler.max_spec_tokens=2: the engine derives it",
        ),
        (
            lambda: EngineConfig(scheduler=SchedulerConfig(chunk_align_tokens=16)),
            "scheduler.chunk_align_tokens=16",
        ),
    ],
)
def test_refusals_name_the_value_and_the_fix(build, match: str) -> None:
    with pytest.raises(EngineError, match=match):
        build()


def test_config_and_keywords_give_the_same_engine() -> None:
    limits = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=16)
    by_config = LLM(DEMO_MAIN, config=EngineConfig(memory_bytes=8 << 20, scheduler=limits))
    by_keywords = LLM(
        DEMO_MAIN, memory_bytes=8 << 20, max_num_seqs=4, max_num_batched_tokens=64, chunk_size=16
    )
    assert by_config.config == by_keywords.config
    assert by_config.plan == by_keywords.plan
    running = by_config.scheduler.config
    assert running == by_keywords.scheduler.config
    # the caller's limits, and what the engine derived: max_model_len, K, alignment
    assert (running.max_num_seqs, running.max_num_batched_tokens, running.chunk_size) == (4, 64, 16)
    assert running.max_model_len == by_config.max_model_len and running.max_spec_tokens == 0
    first, second = (
        llm.generate(["def main("], max_new_tokens=4, ignore_eos=True)[0]
        for llm in (by_config, by_keywords)
    )
    assert isinstance(first, GenerationResult)
    assert first.token_ids == second.token_ids and len(first.token_ids) == 4


def test_the_engine_exports_its_public_names() -> None:
    import hybridkv.engine

    assert hybridkv.engine.__all__ == ["EngineConfig", "GenerationResult", "LLM", "SamplingParams"]
    assert SamplingParams(max_new_tokens=2).max_new_tokens == 2
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = hybridkv.engine.Nope  # type: ignore[attr-defined]


def test_config_and_keywords_together_are_refused() -> None:
    with pytest.raises(EngineError, match=r"config= and the keywords \['dtype'\]"):
        LLM(DEMO_MAIN, config=EngineConfig(), dtype="float32")
