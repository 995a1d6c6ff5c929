"""Exactness tests run many tiny matmuls; one intra-op thread avoids oversubscribing
small CI machines (several times faster there, and results do not depend on it)."""

from __future__ import annotations

try:
    import torch
except ImportError:  # the tests themselves skip without torch
    torch = None  # type: ignore[assignment]

if torch is not None:
    torch.set_num_threads(1)


if torch is not None:
    import pytest

    @pytest.fixture(scope="session")
    def llm_case(tmp_path_factory):
        """``llm_case(name)``: a tiny float32 checkpoint, its prompts and transformers'
        greedy tokens, built once per session (see llm_support.py)."""
        from llm_support import build_case

        cache = {}

        def get(name):
            if name not in cache:
                cache[name] = build_case(name, tmp_path_factory.mktemp(f"llm_{name}"))
            return cache[name]

        return get
