"""Tables for people and JSON for machines, shared by every command."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(c) for c in row])
    console().print(table)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


@contextmanager
def byte_progress(description: str, err: Console | None = None) -> Iterator[Callable[[int, int], None] | None]:
    """A transfer bar (bytes, rate, time left) on stderr while the block runs, on a terminal only.

    Yields a ``progress(done, total)`` callback that I/O threads may call, or None when stderr is
    not a terminal (logs and pipes get the final table, not a bar)."""
    err = err or console(stderr=True)
    if not err.is_terminal:
        yield None
        return
    bar = Progress(TextColumn(description), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                   console=err, transient=True)
    task = bar.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total or None)

    with bar:
        yield update
