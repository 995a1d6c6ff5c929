"""`hybridkv.vllm` imports one way: its modules form no cycle, production modules do
not use the test helper `hybridkv.cache.toy`, and the test / benchmark drivers
(`harness`, `engine_process`) are imported by no production module.

Imports are read from the source with `ast` (module level, inside functions and under
``TYPE_CHECKING`` alike), so vLLM need not be installed."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridkv

SRC = Path(hybridkv.__file__).parent
VLLM = SRC / "vllm"
DRIVERS = {"hybridkv.vllm.harness", "hybridkv.vllm.engine_process"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (``from a import b`` counts as ``a`` and ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _vllm_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in VLLM.glob("*.py")}
    return {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_vllm_modules_import_one_way() -> None:
    graph = _vllm_graph()
    assert "hybridkv.vllm.builder" in graph and "hybridkv.vllm.hooks" in graph
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


def test_builder_does_not_import_hooks() -> None:
    """The block-size hook installs the builder; the builder reads shared helpers from
    `backend_facts`, never from the hook."""
    graph = _vllm_graph()
    assert "hybridkv.vllm.builder" in graph["hybridkv.vllm.hooks"]
    assert "hybridkv.vllm.hooks" not in graph["hybridkv.vllm.builder"]


def test_cycle_finder_sees_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_production_code_does_not_use_test_helpers() -> None:
    """`hybridkv.cache.toy` is for tests and examples; the test / bench drivers are
    imported only by each other (and by tests, bench and scripts)."""
    offenders = []
    for path in SRC.rglob("*.py"):
        name = _module_name(path)
        if name == "hybridkv.cache.toy" or name in DRIVERS:
            continue
        used = _imports(path) & ({"hybridkv.cache.toy"} | DRIVERS)
        if used:
            offenders.append(f"{name}: {sorted(used)}")
    assert offenders == []
