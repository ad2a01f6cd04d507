"""Plain columns for the commands a user runs most (`gpuq status`): squeue's kind of table, in
colour on a terminal, without Rich (whose import alone is a fifth of the client's budget)."""

from __future__ import annotations

import os
import sys
import unicodedata
from collections.abc import Sequence
from typing import TextIO

from gpuq.cli.render import printable

# A cell: its text, or (text, colour) with a colour named below.
Cell = str | tuple[str, str | None]

_ANSI = {"green": "32", "bold green": "1;32", "red": "31", "yellow": "33", "cyan": "36", "bold": "1"}


def colours_wanted(stream: TextIO | None = None) -> bool:
    """Colour on a terminal, unless NO_COLOR is set (no-color.org)."""
    stream = stream or sys.stdout
    return stream.isatty() and "NO_COLOR" not in os.environ


def width(text: str) -> int:
    """Columns ``text`` takes on a terminal: East Asian wide characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def render(title: str, header: Sequence[str], rows: Sequence[Sequence[Cell]], right: frozenset[str] = frozenset(),
           colour: bool = False, headed: bool = True) -> str:
    """The table as text: a title line, a bold header, a line per row; columns two spaces apart,
    those named in ``right`` aligned right. Control characters in cells are shown escaped. Not
    ``headed``: the rows alone, as squeue -h prints them (the columns as wide as the rows need)."""
    cells = [[c if isinstance(c, tuple) else (c, None) for c in row] for row in rows]
    cells = [[(printable(text), tone) for text, tone in row] for row in cells]
    widths = [max([width(h) if headed else 0] + [width(row[i][0]) for row in cells]) for i, h in enumerate(header)]

    def line(row: Sequence[tuple[str, str | None]]) -> str:
        out = []
        for i, (text, tone) in enumerate(row):
            pad = " " * (widths[i] - width(text))
            shown = f"\x1b[{_ANSI[tone]}m{text}\x1b[0m" if colour and tone in _ANSI else text
            out.append(pad + shown if header[i] in right else shown + pad)
        return "  ".join(out).rstrip()

    lines = [title, line([(h, "bold") for h in header])] if headed else []
    lines += [line(row) for row in cells]
    return "\n".join(lines)


def delimited(header: Sequence[str], rows: Sequence[Sequence[Cell]], headed: bool = True) -> str:
    """The table as sacct -P prints it, for a script to split: each row's cells joined by "|", no
    padding and no colour, under a line of the headers unless not ``headed``. A "|" inside a cell
    (a reason may hold one) is shown as "/", so a line always splits into its columns."""
    lines = [header] if headed else []
    lines += [[printable(c[0] if isinstance(c, tuple) else c).replace("|", "/") for c in row] for row in rows]
    return "\n".join("|".join(line) for line in lines)
