"""Terminal output of the CLI, drawn with rich: live views redrawn in place (`m27 watch`,
`m27 top`), tables (`m27 queue`) and progress bars for long work.

On a terminal a frame is a rich renderable redrawn by `rich.live.Live`: rich measures the
terminal, cuts every row to its width (no wrapped row pushes the frame down) and erases
what a longer frame drew before. When the output is not a terminal (a pipe, a log file,
CI) nothing is redrawn and no escape codes are written: the caller prints plain lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import TextIO

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text


def console(out: TextIO, *, terminal: bool | None = None, width: int | None = None,
            height: int | None = None) -> Console:
    """A console on `out`; `terminal` None: whatever `out` is (rich asks isatty)."""
    return Console(file=out, force_terminal=terminal, width=width, height=height,
                   highlight=False, soft_wrap=False)


def lines(rows: Iterable[str]) -> Group:
    """Plain lines as one renderable, each cut with an ellipsis at the terminal's width."""
    return Group(*(Text(row, no_wrap=True, overflow="ellipsis") for row in rows))


class FitTable:
    """A borderless table whose cells never wrap, laid out for the width it is drawn at:
    when that is too narrow only the `squeeze` columns give up width (cut with an
    ellipsis), the first of them first; the others keep their widest cell."""

    def __init__(self, columns: Sequence[str], rows: Iterable[Sequence[str]], *,
                 right: Sequence[str], squeeze: Sequence[str]) -> None:
        self.columns = tuple(columns)
        self.rows = [tuple(row) for row in rows]
        self.right = frozenset(right)
        self.squeeze_order = tuple(squeeze) if squeeze else self.columns[-1:]

    def widest(self, index: int) -> int:
        return max([cell_len(self.columns[index]),
                    *(cell_len(row[index]) for row in self.rows)])

    def layout(self, max_width: int) -> Table:
        natural = [self.widest(i) for i in range(len(self.columns))]
        gaps = 2 * (len(self.columns) - 1)  # one space each side of every inner edge
        squeezed = [self.columns.index(name) for name in self.squeeze_order]
        fixed = sum(w for i, w in enumerate(natural) if i not in squeezed)
        room = max(0, max_width - fixed - gaps)
        widths = dict(enumerate(natural))
        for n, i in enumerate(squeezed):  # in the order given: the first gives up width first
            later = sum(natural[j] for j in squeezed[n + 1:])
            widths[i] = min(natural[i], max(1, room - later))
            room = max(0, room - widths[i])
        grid = Table(box=None, pad_edge=False, show_edge=False, header_style="bold",
                     expand=False)
        for i, name in enumerate(self.columns):
            grid.add_column(name, no_wrap=True, overflow="ellipsis", width=widths[i],
                            justify="right" if name in self.right else "left")
        for row in self.rows:
            grid.add_row(*row)
        return grid

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.layout(options.max_width)


def table(columns: Sequence[str], rows: Iterable[Sequence[str]], *,
          right: Sequence[str] = (), squeeze: Sequence[str] = ()) -> FitTable:
    """A table for the terminal (see `FitTable`)."""
    return FitTable(columns, rows, right=right, squeeze=squeeze)


class LiveView:
    """A frame redrawn in place on a terminal; off a terminal `live` is False and `draw`
    does nothing (the caller prints lines instead)."""

    def __init__(self, out: TextIO, live: bool | None = None, *,
                 width: int | None = None, height: int | None = None) -> None:
        self.live = out.isatty() if live is None else live
        self._console = console(out, terminal=self.live, width=width, height=height)
        self._live: Live | None = None

    def draw(self, frame: RenderableType) -> None:
        if not self.live:
            return
        if self._live is None:
            self._live = Live(frame, console=self._console, auto_refresh=False,
                              redirect_stdout=False, redirect_stderr=False,
                              vertical_overflow="ellipsis")  # taller: cut, never stale
            self._live.start(refresh=True)
        else:
            self._live.update(frame, refresh=True)

    def close(self) -> None:
        """Leave the last frame on the screen and the cursor below it."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> LiveView:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def progress(out: TextIO, *, terminal: bool | None = None, data: bool = False) -> Progress:
    """Progress bars on `out` (stderr, so piped output stays clean): description, bar,
    percentage, done/total (bytes and speed for `data`), elapsed and remaining time. Off a
    terminal they are disabled: nothing is drawn, logs get no frames."""
    shown = out.isatty() if terminal is None else terminal
    columns: list[ProgressColumn] = [TextColumn("{task.description}"), BarColumn(),
                                     TaskProgressColumn()]
    columns += [DownloadColumn(), TransferSpeedColumn()] if data else [MofNCompleteColumn()]
    columns += [TimeElapsedColumn(), TimeRemainingColumn()]
    return Progress(*columns, console=console(out, terminal=shown), transient=False,
                    disable=not shown)
