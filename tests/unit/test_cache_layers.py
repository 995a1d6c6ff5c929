"""The cache core imports one way (docs/structures.md, DESIGN §11): every module of
`hybridkv.cache` sits in one layer and imports only from its own layer or lower ones,
and the imports form no cycle. Read from the sources with `ast`, so imports under
``if TYPE_CHECKING:`` and inside functions count too."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import PackageSources, find_cycle, upward_imports

import hybridkv.cache

CACHE_DIR = Path(hybridkv.cache.__file__).resolve().parent
PACKAGE = "hybridkv.cache"

# Lowest first. Names are relative to `hybridkv.cache` ("managers" is managers/__init__.py).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("types", ("block", "events", "delta", "rules")),
    (
        "primitives",
        ("hashing", "validate", "loop_detect", "free_queue"),
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


SOURCES = PackageSources(PACKAGE, CACHE_DIR)


def _sources() -> dict[str, Path]:
    return SOURCES.paths


def _imports(module: str, path: Path, modules: set[str]) -> set[str]:
    """The cache modules ``module`` (its source at ``path``) imports, anywhere in it."""
    out = SOURCES.imports(module, path)
    assert out <= modules, f"{module} imports {sorted(out - modules)}, not modules of the cache"
    return out


def _graph() -> dict[str, set[str]]:
    return SOURCES.graph()


def test_every_cache_module_has_a_layer() -> None:
    modules = set(_sources())
    assert sorted(modules - set(RANK)) == [], "place each new cache module in LAYERS"
    assert sorted(set(RANK) - modules) == [], "LAYERS names modules that do not exist"


def test_cache_imports_point_down() -> None:
    upward = upward_imports(_graph(), RANK.__getitem__, lambda module: LAYERS[RANK[module]][0])
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_cache_imports_have_no_cycle() -> None:
    cycle = find_cycle(_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


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
