"""Who imports whom inside a package, read from the sources with `ast`, so imports under
``if TYPE_CHECKING:`` and inside functions count too. The layer tests
(tests/unit/test_cache_layers.py, tests/unit/test_engine_layers.py, tests/unit/test_cli_package.py)
build on it."""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


def imported_names(path: Path, package: str) -> list[list[str]]:
    """What the source at ``path`` imports, anywhere in it: per imported name the absolute
    module names it may stand for, most specific first (``import a.b`` -> ``[a.b]``;
    ``from a import b`` -> ``[a.b, a]``: ``b`` is a submodule or a name defined in ``a``).
    ``package`` is the package the file belongs to (relative imports resolve against it)."""
    names: list[list[str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            names += [[f"{base}.{alias.name}", base] for alias in node.names]
    return names


class PackageSources:
    """The modules of one package: names relative to it ("__init__" for the package
    itself, "sub" for sub/__init__.py) and their source files."""

    def __init__(self, package: str, root: Path) -> None:
        self.package = package
        self.root = root
        self.paths: dict[str, Path] = {self._relative(p): p for p in sorted(root.rglob("*.py"))}

    def _relative(self, path: Path) -> str:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        return ".".join(parts)

    def module_of(self, name: str) -> str | None:
        """The package's module an absolute module name names (None: outside it)."""
        if name == self.package:
            return "__init__"
        if not name.startswith(self.package + "."):
            return None
        return name[len(self.package) + 1 :]

    def qualified(self, module: str) -> str:
        return self.package if module == "__init__" else f"{self.package}.{module}"

    def imports(self, module: str, path: Path | None = None) -> set[str]:
        """The package's modules ``module`` imports (``from pkg import name``: ``pkg.name``
        when that is a module, else ``pkg``). ``path``: read that source as ``module``'s
        instead of its own."""
        path = self.paths[module] if path is None else path
        qualified = self.qualified(module)
        anchor = qualified if path.name == "__init__.py" else qualified.rsplit(".", 1)[0]
        out: set[str] = set()
        for candidates in imported_names(path, anchor):
            targets = [self.module_of(name) for name in candidates]
            target = next((t for t in targets if t in self.paths), targets[-1])
            if target is None or target == module:
                continue
            if target not in self.paths:
                raise AssertionError(
                    f"{module} imports {candidates[-1]}, not a module of {self.package}"
                )
            out.add(target)
        return out

    def graph(self) -> dict[str, set[str]]:
        return {module: self.imports(module) for module in self.paths}


def upward_imports(
    graph: Mapping[str, set[str]], rank: Callable[[str], int], layer_name: Callable[[str], str]
) -> list[str]:
    """Each edge from a module to one of a higher rank, as readable lines."""
    return [
        f"{module} ({layer_name(module)}) imports {target} ({layer_name(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if rank(target) > rank(module)
    ]


def find_cycle(graph: Mapping[str, set[str]]) -> Sequence[str]:
    """One import cycle as a path that ends where it starts, or () when there is none."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> Sequence[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return ()
        for target in sorted(graph[module]):
            cycle = visit(target, [*path, module])
            if cycle:
                return cycle
        done.add(module)
        return ()

    for module in sorted(graph):
        cycle = visit(module, [])
        if cycle:
            return cycle
    return ()
