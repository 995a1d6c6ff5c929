"""Build hook for the opt-in compiled cache core (docs/performance.md).

Pure Python is the default and the reference. ``HYBRIDKV_COMPILE=1`` compiles the
modules of `hybridkv.cache` (`COMPILED_MODULES`) with mypyc into C extensions that sit
beside the sources; `hybridkv.cache.COMPILED` and ``hybridkv --version`` tell which build
is loaded. mypyc comes from the dev extra, so the build must see it::

    pip install -e ".[dev]"                                      # mypy / mypyc, a C compiler
    HYBRIDKV_COMPILE=1 pip install --no-build-isolation -v .     # a compiled install
    HYBRIDKV_COMPILE=1 pip install --no-build-isolation --no-deps --target build/compiled .
        # a compiled copy beside the checkout: PYTHONPATH=build/compiled (CI, the benchmark)

Without mypyc or a C compiler the build falls back to pure Python and says so (pip
shows a build's output with ``-v``). A build without the flag deletes compiled modules
an earlier ``HYBRIDKV_COMPILE=1 pip install -e .`` left in ``src/`` (Python would load
them before the sources).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
CACHE_DIR = Path("src", "hybridkv", "cache")
# Everything a manager call runs through; `__init__` (which reports the build) and
# `toy` (test plans) stay interpreted.
INTERPRETED = {"__init__.py", "toy.py"}
GROUP_NAME = "hybridkv_cache"  # the shared library: hybridkv_cache__mypyc.<suffix>


def _say(message: str) -> None:
    print(f"hybridkv build: {message}", file=sys.stderr, flush=True)


def compiled_sources() -> list[str]:
    paths = sorted((HERE / CACHE_DIR).rglob("*.py"))
    return [
        str(p.relative_to(HERE)).replace(os.sep, "/") for p in paths if p.name not in INTERPRETED
    ]


def _remove_stale_extensions() -> None:
    """A pure build must not leave an editable compiled build's modules in ``src/``."""
    stale = [*(HERE / CACHE_DIR).rglob("*.so"), *(HERE / CACHE_DIR).rglob("*.pyd")]
    stale += [*(HERE / "src").glob(f"{GROUP_NAME}__mypyc*")]
    for path in stale:
        path.unlink()
    if stale:
        _say(f"removed {len(stale)} compiled modules of an earlier build from src/")


class OptionalBuildExt(build_ext):
    """build_ext that falls back to pure Python when no C compiler works."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler, missing headers: the sources still work
            self._fall_back(exc)

    def _fall_back(self, exc: Exception) -> None:
        for ext in self.extensions:
            for path in (self.get_ext_fullpath(ext.name),):
                if os.path.exists(path):
                    os.unlink(path)
        self.extensions = []
        _say(
            f"the C compiler failed ({type(exc).__name__}: {exc}); installing the pure-Python "
            "cache core (hybridkv.cache.COMPILED is False)"
        )


def ext_modules() -> list:
    if os.environ.get("HYBRIDKV_COMPILE", "").lower() not in ("1", "true", "yes"):
        _remove_stale_extensions()
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        _say(
            f"HYBRIDKV_COMPILE is set but mypyc is not importable ({exc}); installing the "
            "pure-Python cache core. Install the dev extra (mypy) and build with "
            "pip's --no-build-isolation"
        )
        return []
    _say(f"compiling {len(compiled_sources())} cache modules with mypyc")
    try:
        return mypycify(compiled_sources(), opt_level="3", group_name=GROUP_NAME)
    except (Exception, SystemExit) as exc:  # mypy errors exit: say so, stay pure Python
        _say(f"mypyc failed ({type(exc).__name__}: {exc}); installing the pure-Python core")
        return []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
