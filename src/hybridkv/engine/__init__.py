"""The reference engine (torch). `LLM` is imported lazily so that importing
``hybridkv.engine`` for its submodules stays cheap."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from hybridkv.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'hybridkv.engine' has no attribute {name!r}")
