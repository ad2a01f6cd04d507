"""Progress bars for commands that wait: `gpuq wait` (jobs ended of all) and `gpuq logs -f` of a
training job (its epochs). Only on a terminal, or when asked (``--progress``): scripts and pipes get
the plain output. rich is imported only when a bar is drawn.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

Advance = Callable[[int, str], None]  # (completed, description) -> None


def wanted(flag: bool | None, *streams: IO[str]) -> bool:
    """``--progress``/``--no-progress`` if given, else whether every stream is a terminal."""
    if flag is not None:
        return flag
    return all(s.isatty() for s in streams)


@contextmanager
def bar(total: int, description: str, *, show: bool, stream: IO[str], unit: str = "") -> Iterator[Advance]:
    """A bar of ``total`` steps on ``stream``; yields ``advance(completed, description)``. With
    ``show`` false, yields a no-op so callers need no branch. Writes to ``sys.stdout`` while the bar
    is up appear above it (rich redirects them), so output and bar do not garble each other."""
    if not show:
        yield lambda completed, text: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=stream, force_terminal=True)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    if unit:
        columns.append(TextColumn(unit))
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=False,
                  redirect_stdout=stream is sys.stdout, redirect_stderr=False) as progress:
        task = progress.add_task(description, total=total)

        def advance(completed: int, text: str) -> None:
            progress.update(task, completed=completed, description=text)

        yield advance
