"""The cache core imports one way (docs/structures.md, DESIGN §11): every module of
`hybridkv.cache` sits in one layer and imports only from its own layer or lower ones,
and the imports form no cycle. Read from the sources with `ast`, so imports under
``if TYPE_CHECKING:`` and inside functions count too."""

from __future__ import annotations

import ast
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
        ("hashing", "validate", "loop_detect", "free_queue", "chain_queue"),
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


# Whose attributes cache code may set besides its own (``self.x = ...``): the records of
# one request (`RequestRecord`, a group's per-request state, its `GroupLimits`), the
# shared statistics (`Counters`) and the junction rule's `ChildIndex` (data the pool
# owns, filled by the rule that acts on one group). Configuration is never among them:
# it arrives in `CacheRules` at construction.
DATA_RECEIVERS = {"r", "state", "states[g]", "lim", "children", "self.counters", "self._counters"}


def _foreign_sets(path: Path) -> set[str]:
    """The receivers of attribute assignments in ``path`` other than ``self``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for sub in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(sub, ast.Attribute) and ast.unparse(sub.value) != "self":
                    out.add(ast.unparse(sub.value))
    return out


def test_cache_objects_are_not_configured_from_outside():
    """No switch is poked into a pool, free queue, group manager or coordinator after
    construction (`CacheRules`, DESIGN §11): cache code sets attributes of ``self`` and
    of the data records in `DATA_RECEIVERS` only."""
    pokes = {
        f"{module}: {receiver}.<attr> = ..."
        for module, path in _sources().items()
        for receiver in _foreign_sets(path) - DATA_RECEIVERS
    }
    assert sorted(pokes) == [], "attributes set on another object:\n" + "\n".join(sorted(pokes))


def test_the_poke_checker_sees_nested_and_augmented_assignments(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text(
        "def f(self, pool, manager):\n"
        "    self.ok = 1\n"
        "    pool.spans = {}\n"
        "    manager.pool.free.windowed = True\n"
        "    self.loops.clock += 1\n"
        "    a, pool.hot = 1, True\n"
    )
    assert _foreign_sets(path) == {"pool", "manager.pool.free", "self.loops"}
