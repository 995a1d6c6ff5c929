"""The engine's subpackages import one way (docs/structures.md): every module of
`hybridkv.engine` sits in the layer of its subpackage (the modules directly under
``engine/`` form the top one) and imports only from its own layer or lower ones; the
modules import no cycle; and nothing in the engine imports the rooms built on it (the
CLI, the server, the simulator, the vLLM plugin). Read from the sources with `ast`, so
imports under ``if TYPE_CHECKING:`` and inside functions count too."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import PackageSources, find_cycle, imported_names, upward_imports

import hybridkv.engine

ENGINE_DIR = Path(hybridkv.engine.__file__).resolve().parent
SOURCES = PackageSources("hybridkv.engine", ENGINE_DIR)

# Lowest first; each layer one concern.
LAYERS: list[tuple[str, str]] = [
    ("sampling", "sampling parameters, logits processing, token sampling, logprobs"),
    ("ops", "the batch a step sees and the kernels that read it"),
    ("models", "model code, checkpoint loading, tokenizers, the demo checkpoints"),
    ("forward", "cache tensors, device block tables, junction copies, the runner"),
    ("speculative", "drafters, proposers, verification, token trees"),
    ("top", "LLM, its config and options, the stepper, results, threads"),
]
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}
SUBPACKAGES = {name for name, _ in LAYERS} - {"top"}
ABOVE_THE_ENGINE = ("hybridkv.cli", "hybridkv.serve", "hybridkv.sim", "hybridkv.vllm")


def layer(module: str) -> str:
    head = module.split(".")[0]
    return head if head in SUBPACKAGES else "top"


def test_every_subpackage_has_a_layer() -> None:
    packages = {p.parent.name for p in ENGINE_DIR.glob("*/__init__.py")}
    assert packages == SUBPACKAGES, "place each engine subpackage in LAYERS"


def test_engine_imports_point_down() -> None:
    upward = upward_imports(SOURCES.graph(), lambda m: RANK[layer(m)], layer)
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_engine_imports_have_no_cycle() -> None:
    cycle = find_cycle(SOURCES.graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_engine_imports_nothing_built_on_it() -> None:
    found = [
        f"{module} imports {name}"
        for module, path in sorted(SOURCES.paths.items())
        for candidates in imported_names(path, SOURCES.qualified(module))
        for name in candidates[-1:]
        if any(name == room or name.startswith(room + ".") for room in ABOVE_THE_ENGINE)
    ]
    assert found == []


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """A type-only import from ops into the runner is an upward edge."""
    path = tmp_path / "probe.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from hybridkv.engine.forward.runner import ModelRunner\n"
        "from hybridkv.engine.ops import scratch\n"
    )
    graph = {"ops.kv_io": SOURCES.imports("ops.kv_io", path)}
    assert graph["ops.kv_io"] == {"forward.runner", "ops.scratch"}
    assert upward_imports(graph, lambda m: RANK[layer(m)], layer) == [
        "ops.kv_io (ops) imports forward.runner (forward)"
    ]
