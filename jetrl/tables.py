"""Two-column text tables of a result's ``rows()`` (a run's summary, an evaluation's accuracies), as ``jetrl``
prints them: rendered by rich without colour codes, so the text is the same in a terminal, a pipe or a file.
A leaf module: it imports nothing of jetrl.
"""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.table import Table


def text_table(rows: Sequence[tuple[str, str]], title: str | None = None) -> str:
    """A two-column text table (names left, values right), rendered by rich without colour codes."""
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in rows:
        table.add_row(name, value)
    console = Console(file=None, width=100, force_terminal=False, color_system=None)
    with console.capture() as capture:
        console.print(table)
    return ((title + "\n") if title else "") + capture.get().rstrip("\n")


__all__ = ["text_table"]
