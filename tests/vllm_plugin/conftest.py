"""Fixtures for the `-m vllm` tests: they run in the virtualenv that
``scripts/install_vllm_cpu.sh`` makes (vLLM's CPU engine + hybridkv), never in the
default suite."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridkv.vllm.tiny_models import write_tiny_qwen3_next

    return write_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return sys.executable  # these tests run inside vLLM's venv


def engine(
    python: str, settings: dict[str, object], *, plugin: bool, env: dict[str, str] | None = None
) -> Iterator[object]:
    from hybridkv.vllm.engine_process import EngineProcess

    proc = EngineProcess(python, settings, plugin=plugin, env=env)
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybridkv.vllm.tiny_models import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))
