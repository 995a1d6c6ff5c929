"""Tables that fit the terminal without cutting a value.

rich shrinks every column of a table wider than the console, numbers included, and a
column that may not wrap is then cut ("1680" shown as "16"). `fit_table` never lets rich
choose: it measures the cells and picks one of three forms for the console's width::

    1. whole        every cell on its lines, as written
    2. wrapped      the `Column.breaks` columns (layer lists, specs, sources) share what
                    the others leave, each wrapped after its break characters; every
                    other column keeps its natural width
    3. stacked      one record per row, "header: value" pairs, no table at all

Worked example (the plan's comparison table, 6 columns, 19 columns of borders and
padding): its natural width is 54 + 19 = 73, so 80 columns get form 1 and 60 columns
form 3. A value longer than the whole console is the only thing ever folded.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class Column:
    """``breaks``: characters a cell may be wrapped after ("" = never wrapped: numbers,
    names, sizes); ``min_width``: the narrowest a wrapped column may get before the
    table gives way to the stacked form (narrower columns read as a word per line)."""

    header: str
    justify: str = "left"
    breaks: str = ""
    min_width: int = 0


def wrap_at(text: str, width: int, breaks: str) -> list[str]:
    """``text`` in lines of at most ``width`` characters, each line broken only after a
    character of ``breaks`` (a space is dropped at the break); a piece longer than
    ``width`` stays whole on its own line.

    ``wrap_at("main.0-2,4-6,8-10 draft.0", 10, ", ")`` ->
    ``["main.0-2,", "4-6,8-10", "draft.0"]``.
    """
    lines: list[str] = []
    for paragraph in text.split("\n"):
        pieces, start = [], 0
        for i, char in enumerate(paragraph):
            if char in breaks:
                pieces.append(paragraph[start : i + 1])
                start = i + 1
        pieces.append(paragraph[start:])
        line = ""
        for piece in pieces:
            if line and len((line + piece).rstrip()) > width:
                lines.append(line.rstrip())
                line = piece.lstrip()
            else:
                line += piece
        lines.append(line.rstrip())
    return lines


def _longest_piece(text: str, breaks: str) -> int:
    return max(len(line) for line in wrap_at(text, 1, breaks)) if text else 0


def _natural(column: Column, cells: list[str]) -> int:
    widest = max((len(line) for cell in cells for line in cell.split("\n")), default=0)
    return max(widest, _longest_piece(column.header, " "))


def fit_table(
    title: str, columns: list[Column], rows: list[list[str]], width: int
) -> RenderableType:
    """``rows`` (plain text cells, "\\n" between lines) as the widest form that fits
    ``width`` (module doc); the cells are escaped here, never read as rich markup."""
    by_column = [[row[i] for row in rows] for i in range(len(columns))]
    natural = [_natural(c, cells) for c, cells in zip(columns, by_column, strict=True)]
    borders = 3 * len(columns) + 1  # "│ " before each cell, " │" after the last
    if sum(natural) + borders <= width:
        return _table(title, columns, rows, natural)
    flexible = [i for i, c in enumerate(columns) if c.breaks]
    floors = [
        max(c.min_width, _longest_piece("\n".join(cells), c.breaks), _natural(c, []))
        if c.breaks
        else natural[i]
        for i, (c, cells) in enumerate(zip(columns, by_column, strict=True))
    ]
    if flexible and sum(floors) + borders <= width:
        widths = list(floors)
        spare = width - borders - sum(floors)
        wants = {i: natural[i] - floors[i] for i in flexible}
        total = sum(wants.values()) or 1
        for i in flexible:  # the spare columns, shared as each column would use them
            widths[i] += min(wants[i], spare * wants[i] // total)
        wrapped = [
            [
                "\n".join(wrap_at(cell, widths[i], columns[i].breaks)) if i in flexible else cell
                for i, cell in enumerate(row)
            ]
            for row in rows
        ]
        return _table(title, columns, wrapped, widths)
    return _stacked(title, columns, rows, width)


def _table(title: str, columns: list[Column], rows: list[list[str]], widths: list[int]) -> Table:
    """A rich table whose every column has its width set and nothing left to wrap."""
    table = Table(title=title, title_justify="left")
    for column, width in zip(columns, widths, strict=True):
        header = "\n".join(wrap_at(column.header, width, " "))
        table.add_column(
            escape(header),
            justify=column.justify,  # type: ignore[arg-type]
            width=width,
            no_wrap=True,
        )
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    return table


def _stacked(title: str, columns: list[Column], rows: list[list[str]], width: int) -> Group:
    """One record per row: the unbreakable columns as "header: value" pairs packed into
    lines (a pair is never split), then each wrapped column on lines of its own."""
    lines: list[str] = [title]
    for row in rows:
        pairs = [
            f"{c.header}: {' '.join(cell.split())}"
            for c, cell in zip(columns, row, strict=True)
            if not c.breaks
        ]
        record = [""]
        for pair in pairs:
            if record[-1] and len(record[-1]) + 2 + len(pair) > width - 2:
                record.append(pair)
            else:
                record[-1] = f"{record[-1]}  {pair}" if record[-1] else pair
        lines += [("- " if i == 0 else "  ") + line for i, line in enumerate(record)]
        for c, cell in zip(columns, row, strict=True):
            if c.breaks:
                text = f"{c.header}: " + " ".join(cell.split("\n"))
                lines += ["  " + line for line in wrap_at(text, width - 2, c.breaks + " ")]
    return Group(*(Text(line, no_wrap=True, overflow="fold") for line in lines))
