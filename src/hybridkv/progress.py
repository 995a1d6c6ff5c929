"""Progress bars for long CLI work (bench, simulate, trace-gen, demo), quiet in logs.

A bar shows only when stdout is a terminal and the command was not asked for ``--json``:
piped or logged output, and machine-readable output, carry no bar at all. The bar is
transient (it disappears when the work ends) and goes to the same console as the
command's output, so text printed meanwhile lands above it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def bar_enabled(quiet: bool = False) -> bool:
    """Whether a bar would show: not ``quiet`` (``--json``) and stdout is a terminal."""
    return not quiet and sys.stdout.isatty()


# The bar on screen, if any: rich allows one live display at a time, so a bar opened
# inside another (a benchmark's grid under `hybridkv bench`) becomes a row of it.
_ON_SCREEN: list[Any] = []


@contextmanager
def progress_bar(
    description: str, total: float | None, *, quiet: bool = False
) -> Iterator[Callable[[float], None]]:
    """Yields ``advance(n)``; ``total=None`` is a bar without an end (elapsed time only)."""
    if not bar_enabled(quiet):
        yield lambda n: None
        return
    if _ON_SCREEN:
        outer = _ON_SCREEN[-1]
        task = outer.add_task(description, total=total)
        try:
            yield lambda n: outer.advance(task, n)
        finally:
            outer.remove_task(task)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn())
    with Progress(*columns, MofNCompleteColumn(), TimeElapsedColumn(), transient=True) as bar:
        _ON_SCREEN.append(bar)
        try:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)
        finally:
            _ON_SCREEN.pop()
