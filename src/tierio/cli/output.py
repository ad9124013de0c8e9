"""Tables for people and JSON for machines, shared by every command: the one output module.

Every text that comes from data (paths, URLs, tensor names, messages of errors) is printed as plain
text, never parsed as rich markup: ``[tensor 'w' chunk 0]`` or ``/data/exp[v2]`` stay what they are.
Commands style their own words with ``styled`` and print lines with ``say``; tables fold long cells
at spaces instead of cutting them, and move long note columns below the table as numbered notes.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.progress import (
    BarColumn, DownloadColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn,
    TimeRemainingColumn, TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

# columns whose texts are explanations, not figures: printed below the table as numbered notes
NOTE_COLUMNS = ("note", "fix")
# a cell that is a figure (a number with an optional unit, a price, a dash): right-aligned
_FIGURE = re.compile(r"^([~≈<>+-]?\$?[\d][\d.,]*( ?[^\s\d]{1,6})?( / [\d][\d.,]*( ?[^\s\d]{1,6})?)*|[-—]|)$")


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


def styled(text: Any, style: str) -> Text:
    """A command's own emphasis (``styled("BAD", "red")``); the text itself is never markup."""
    return Text(str(text), style=style)


def say(*parts: str | Text, err: bool = False) -> None:
    """Print a line assembled from plain strings and ``styled`` pieces, wrapped at spaces only."""
    console(stderr=err).print(Text.assemble(*parts), overflow="fold")


def cell(value: Any) -> Text:
    """A value as a person reads it: None and booleans as words, everything else as plain text."""
    if isinstance(value, Text):
        return value
    if value is None:
        return Text("-")
    if isinstance(value, bool):
        return Text("yes" if value else "no")
    return Text(str(value))


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A table that is readable at any width, 80 columns included.

    Cells wrap at spaces and fold only a word wider than its whole column (never an ellipsis);
    figures are right-aligned, text left-aligned. A last column named "note" or "fix" goes below
    the table as numbered notes, its number ``[n]`` after the row's first cell."""
    columns = list(columns)
    body = [[cell(c) for c in row] for row in rows]
    notes: list[Text] = []
    if len(columns) > 1 and columns[-1] in NOTE_COLUMNS:
        # the note leaves the table; its number goes on the row's first cell: a whole column saved
        columns.pop()
        for row in body:
            note = row.pop() if len(row) > len(columns) else Text("")
            if note.plain.strip():
                notes.append(note)
                row[0] = Text.assemble(row[0], f" [{len(notes)}]")
    out = console()
    # the title on lines of its own, wrapped at spaces: a URL in it is not cut at the table's width
    out.print(Text(title, style="bold"), overflow="fold")
    table = Table(show_header=True, header_style="bold")
    frame = 3 * len(columns) + 1  # a border and two spaces of padding per column, one border more
    widths = _widths([[Text(c) for c in columns], *body], out.width - frame)
    for i, col in enumerate(columns):
        figures = [r[i].plain for r in body if i < len(r)]
        right = i > 0 and bool(figures) and all(_FIGURE.match(f) for f in figures)
        table.add_column(Text(col), justify="right" if right else "left", overflow="fold", no_wrap=False,
                         width=None if widths is None else widths[i])
    for row in body:
        table.add_row(*row)
    # when not even the longest words fit the screen, the table is printed wider than it rather
    # than cutting them (a terminal wraps the lines; a pipe or a log keeps them)
    out.print(table, width=max(out.width, sum(widths) + frame) if widths else None)
    for n, note in enumerate(notes, 1):
        out.print(Text.assemble(f"[{n}] ", note), overflow="fold")


MIN_FOLD = 12  # a column a long word folds into keeps at least this many characters


def _widths(rows: list[list[Text]], room: int) -> list[int] | None:
    """Column widths that keep every word whole, or None when the table fits as it is.

    rich shrinks the widest columns first when a table is too wide, which folds words (numbers,
    tensor names, header words) even where narrower columns could have wrapped at a space. Here each
    column gets at least its longest word, and the room left is shared out (see below)."""
    ncols = max(len(r) for r in rows)
    lo, hi = [1] * ncols, [1] * ncols
    for row in rows:
        for i, t in enumerate(row):
            for line in t.plain.splitlines() or [""]:
                hi[i] = max(hi[i], cell_len(line))
                # a figure ("11.7 s", "$95.57") is one word: its number and unit stay on one line
                words = [line] if _FIGURE.match(line) else line.split()
                lo[i] = max(lo[i], *(cell_len(w) for w in words), 1)
    if sum(hi) <= room:
        return None
    spare = room - sum(lo)
    if spare <= 0:
        # Not even the words fit. The console cannot print wider than itself, so one word must
        # fold: the longest ones (a path, a URL), never the short words of the other columns.
        widths = list(lo)
        while sum(widths) > room:
            widest = max(range(ncols), key=lambda i: widths[i])
            second = max((w for i, w in enumerate(widths) if i != widest), default=1)
            cut = min(sum(widths) - room, widths[widest] - max(second, MIN_FOLD))
            if cut <= 0:
                break
            widths[widest] -= cut
        return widths
    # water-filling: the columns that want little get all of it (a short check name stays on one
    # line), the wide ones share what is left equally
    want = [h - low for h, low in zip(hi, lo)]
    widths = list(lo)
    order = sorted(range(ncols), key=lambda i: want[i])
    for k, i in enumerate(order):
        give = min(want[i], spare // (ncols - k))
        widths[i] += give
        spare -= give
    return widths


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


@contextmanager
def progress(description: str, total: int | None = None, *, quiet: bool = False,
             err: Console | None = None) -> Iterator[Callable[..., None]]:
    """A bar (when the number of items is known) or a spinner, with the time elapsed, on stderr.

    For every command that can take more than a second. Yields ``advance(n=1, note="")``, which
    does nothing when the bar is silent: with --json (``quiet``) and when stderr is not a terminal
    (a log or a pipe gets the final table, not the animation)."""
    err = err or console(stderr=True)
    if quiet or not err.is_terminal:
        yield lambda n=1, note="": None
        return
    columns: list[ProgressColumn | str] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns += [TimeElapsedColumn(), TextColumn("{task.fields[note]}")]
    bar = Progress(*columns, console=err, transient=True)
    task = bar.add_task(description, total=total or None, note="")

    def advance(n: int = 1, note: str = "") -> None:
        bar.update(task, advance=n, note=note)

    with bar:
        yield advance


@contextmanager
def byte_progress(description: str, err: Console | None = None, *,
                  quiet: bool = False) -> Iterator[Callable[[int, int], None] | None]:
    """A transfer bar (bytes, rate, time left) on stderr while the block runs, on a terminal only.

    Yields a ``progress(done, total)`` callback that I/O threads may call, or None when stderr is
    not a terminal (logs and pipes get the final table, not a bar)."""
    err = err or console(stderr=True)
    if quiet or not err.is_terminal:
        yield None
        return
    bar = Progress(TextColumn(description), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                   console=err, transient=True)
    task = bar.add_task(description, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total or None)

    with bar:
        yield update
