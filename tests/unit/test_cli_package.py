"""The command line is one package on top (docs/structures.md): `hybridkv.cli` holds every
command and its options; no module outside it imports it (the console script and
``python -m hybridkv`` are its entry points), so the library never pulls in typer or
rich. `hybridkv.demo` (the demo checkpoints' paths and prompts, public for users and
tests) is imported by nothing else in the package either, and imports nothing of
hybridkv. Read from the sources with `ast`, so imports under ``if TYPE_CHECKING:`` and
inside functions count too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib
from tests.import_graph import imported_names

import hybridkv
from hybridkv.cli import main
from hybridkv.cli.root import _register_optional_commands, app

SRC = Path(hybridkv.__file__).resolve().parent
REPO = SRC.parents[1]
ENTRY_POINTS = {"hybridkv.__main__"}  # `python -m hybridkv`
COMMANDS = {"plan", "models", "bench", "trace-gen", "simulate", "generate", "demo", "serve"}


ONLY_FOR_THE_CLI = ("hybridkv.cli", "hybridkv.demo")


def _under(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def _modules(src: Path) -> list[tuple[str, Path]]:
    """(module name, source) for every module under ``src`` (the ``hybridkv`` folder)."""
    out = []
    for path in sorted(src.rglob("*.py")):
        parts = ["hybridkv", *path.relative_to(src).with_suffix("").parts]
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def cli_imports_outside_the_cli(src: Path) -> list[str]:
    """``module imports name`` for every import of `hybridkv.cli` (or a submodule) or of
    `hybridkv.demo` by a module under ``src`` outside the CLI package and its entry
    points, sorted."""
    found = []
    for module, path in _modules(src):
        if _under(module, ONLY_FOR_THE_CLI) or module in ENTRY_POINTS:
            continue
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for candidates in imported_names(path, package):
            # candidates[-1] is the module imported from; candidates[0] the full name
            # (`from hybridkv import cli` imports from `hybridkv`, and names the CLI)
            if _under(candidates[-1], ONLY_FOR_THE_CLI) or _under(candidates[0], ONLY_FOR_THE_CLI):
                found.append(f"{module} imports {candidates[0]}")
    return sorted(found)


def test_nothing_outside_the_cli_imports_it_or_the_demo() -> None:
    assert cli_imports_outside_the_cli(SRC) == []


def test_the_demo_module_is_a_leaf() -> None:
    """`hybridkv.demo` holds paths and prompts: it imports nothing of hybridkv, so no
    import can reach up through it."""
    path = SRC / "demo.py"
    names = [c[-1] for c in imported_names(path, "hybridkv")]
    assert [n for n in names if _under(n, ("hybridkv",))] == []
    assert (SRC / "cli" / "demo.py").is_file()  # the command


def test_the_checker_sees_a_lazy_import(tmp_path: Path) -> None:
    """An import inside a function, a relative one, ``from hybridkv import cli`` and the
    demo count."""
    root = tmp_path / "hybridkv"
    (root / "serve").mkdir(parents=True)
    (root / "serve" / "probe.py").write_text(
        "def f():\n    from hybridkv.cli.engine import load_llm\n    return load_llm\n"
        "from ..cli import options\n"
        "from hybridkv import cli\n"
        "import hybridkv.demo\n"
    )
    found = cli_imports_outside_the_cli(root)
    assert found == [
        "hybridkv.serve.probe imports hybridkv.cli",
        "hybridkv.serve.probe imports hybridkv.cli.engine.load_llm",
        "hybridkv.serve.probe imports hybridkv.cli.options",
        "hybridkv.serve.probe imports hybridkv.demo",
    ]


def test_the_console_script_is_the_cli_main() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"hybridkv": "hybridkv.cli:main"}
    assert callable(main)


def test_every_command_registers_on_the_one_app() -> None:
    _register_optional_commands()
    names = {command.name for command in app.registered_commands}
    assert names == COMMANDS


def test_python_m_hybridkv_lists_every_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hybridkv", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "120", "PATH": "", "PYTHONPATH": str(SRC.parent)},
    )
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")}
    assert listed >= COMMANDS, result.stdout
