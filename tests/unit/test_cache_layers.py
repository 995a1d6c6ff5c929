"""The cache core imports one way (docs/structures.md, DESIGN §11): every module of
`hybridkv.cache` sits in one layer and imports only from its own layer or lower ones,
and the imports form no cycle. Read from the sources with `ast`, so imports under
``if TYPE_CHECKING:`` and inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridkv.cache

CACHE_DIR = Path(hybridkv.cache.__file__).resolve().parent
PACKAGE = "hybridkv.cache"

# Lowest first. Names are relative to `hybridkv.cache` ("managers" is managers/__init__.py).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("types", ("block", "events", "delta")),
    (
        "primitives",
        ("hashing", "validate", "loop_detect", "free_queue_reads", "free_queue_lru", "free_queue"),
    ),
    ("pool", ("indexes", "block_pool")),
    (
        "groups",
        (
            "managers.base",
            "turn_end",
            "junction",
            "managers.full",
            "managers.sliding",
            "managers.chunked",
            "managers.state",
            "managers.state_columns",
            "managers",
        ),
    ),
    ("coordinator", ("coordinator",)),
    ("facade", ("request", "needs", "views", "step_paths", "manager", "toy", "__init__")),
]
RANK = {module: rank for rank, (_, modules) in enumerate(LAYERS) for module in modules}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(CACHE_DIR).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(CACHE_DIR.rglob("*.py"))}


def _cache_module(name: str) -> str | None:
    """The cache module an absolute module name names (None: outside the cache)."""
    if name == PACKAGE:
        return "__init__"
    return name[len(PACKAGE) + 1 :] if name.startswith(PACKAGE + ".") else None


def _imports(module: str, path: Path, modules: set[str]) -> set[str]:
    """The cache modules ``module`` (its source at ``path``) imports, anywhere in it."""
    qualified = PACKAGE if module == "__init__" else f"{PACKAGE}.{module}"
    package = qualified if path.name == "__init__.py" else qualified.rsplit(".", 1)[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:  # `from pkg import sub` names the submodule
                sub = _cache_module(f"{base}.{alias.name}")
                names.append(f"{base}.{alias.name}" if sub in modules else base)
    out: set[str] = set()
    for name in names:
        target = _cache_module(name)
        if target is None or target == module:
            continue
        assert target in modules, f"{module} imports {name}, not a module of the cache"
        out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    modules = set(sources)
    return {module: _imports(module, path, modules) for module, path in sources.items()}


def test_every_cache_module_has_a_layer() -> None:
    modules = set(_sources())
    assert sorted(modules - set(RANK)) == [], "place each new cache module in LAYERS"
    assert sorted(set(RANK) - modules) == [], "LAYERS names modules that do not exist"


def test_cache_imports_point_down() -> None:
    upward = [
        f"{module} ({LAYERS[RANK[module]][0]}) imports {target} ({LAYERS[RANK[target]][0]})"
        for module, targets in sorted(_graph().items())
        for target in sorted(targets)
        if RANK[target] > RANK[module]
    ]
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_cache_imports_have_no_cycle() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_checker_sees_type_checking_imports(tmp_path: Path) -> None:
    """An import under ``if TYPE_CHECKING:`` is an edge like any other."""
    path = tmp_path / "probe.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from hybridkv.cache.coordinator import Coordinator\n"
        "from hybridkv.cache import managers\n"
        "from hybridkv.cache.managers import GroupManager\n"
    )
    assert _imports("block", path, set(RANK)) == {"coordinator", "managers"}
