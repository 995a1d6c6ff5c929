"""A model without state layers (Gemma 3 style: sliding window + full attention): vLLM's
block-size rule has nothing to align, so the plugin must leave vLLM exactly as it is."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import engine

pytestmark = pytest.mark.vllm


def test_plugin_leaves_a_sliding_window_model_untouched(
    tiny_gemma3: Path, vllm_python: str
) -> None:
    settings: dict[str, Any] = {"model": str(tiny_gemma3), "max_model_len": 1024}
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 4096) for _ in range(n)] for n in (40, 300)]
    command = {"op": "generate", "prompts": prompts, "max_tokens": 16}
    results = {}
    for plugin in (False, True):
        for proc in engine(vllm_python, settings, plugin=plugin):
            log = proc.kv_log()
            assert log.hybridkv_line is None
            results[plugin] = (log.block_sizes, log.kv_tokens, proc.call(command)["outputs"])
            if plugin:
                assert "hybridkv: planning vLLM's KV cache" in proc.log_text
    assert results[True] == results[False]
