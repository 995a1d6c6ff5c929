"""bench/engine_vs_vllm.py: its prompts, agreement measure, options and refusals (no vLLM)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import engine_vs_vllm as bench  # noqa: E402
from _engine_vs_vllm_sides import VllmSide  # noqa: E402
from hybridkv.errors import HybridKVError  # noqa: E402


def test_prompts_distinct_and_shared() -> None:
    distinct = bench.make_prompts("8")
    assert len(distinct) == 8 and {len(p) for p in distinct} == {bench.PROMPT_TOKENS}
    assert len({tuple(p) for p in distinct}) == 8
    shared = bench.make_prompts("shared32")
    assert len(shared) == 32
    prefix = shared[0][: bench.SHARED_PREFIX_TOKENS]
    assert all(p[: bench.SHARED_PREFIX_TOKENS] == prefix for p in shared)
    tails = {tuple(p[bench.SHARED_PREFIX_TOKENS :]) for p in shared}
    assert len(tails) == 32
    assert all(0 < t < bench.VOCAB for p in shared for t in p)


def test_agreement_counts_rows_and_leading_tokens() -> None:
    a = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert bench.agreement(a, a) == "2/2 rows, lead 4.0/4"
    assert bench.agreement(a, [[1, 2, 9, 4], [0, 6, 7, 8]]) == "0/2 rows, lead 1.0/4"


def test_quick_mode_and_reps() -> None:
    args = bench.parse_args(["--quick"])
    assert (args.reps, args.new_tokens, args.eager, args.cases) == (1, 16, True, "1,8")
    assert bench.parse_args(["--quick", "--cases", "shared32"]).cases == "shared32"
    assert bench.parse_args([]).reps == 5
    assert bench.parse_args(["--quick"]).engine_eager  # the smoke run compiles nothing
    assert not bench.parse_args([]).engine_eager  # both sides compile by default
    assert bench.parse_args(["--engine-eager"]).engine_eager
    with pytest.raises(SystemExit):
        bench.parse_args(["--reps", "0"])


def test_missing_vllm_python_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(HybridKVError, match="no-venv"):
        VllmSide(
            missing,
            tmp_path,
            threads=1,
            device="cpu",
            max_model_len=384,
            max_num_seqs=4,
            eager=True,
        )


def test_the_run_says_which_engine_settings_its_numbers_hold_under(tmp_path: Path) -> None:
    """The benchmark compiles and picks threads itself, unlike `LLM()`; it says so, with
    the `serve` / `generate` flags that run the same engine."""
    compiled = bench.engine_settings(bench.parse_args(["--threads", "2"]), 2, tmp_path)
    assert "LLM(torch_compile=True, dtype='bfloat16'" in compiled
    assert "2 torch thread(s)" in compiled
    assert "defaults are torch_compile=False and 1 thread(s)" in compiled  # no weights: tiny
    assert "--dtype bfloat16 --torch-compile --threads 2" in compiled
    eager = bench.engine_settings(bench.parse_args(["--engine-eager"]), 1, tmp_path)
    assert "LLM(torch_compile=False" in eager and "--no-torch-compile --threads 1" in eager
