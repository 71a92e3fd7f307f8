"""Tailing a step's metrics file (`$M27_METRICS_FILE`) onto the bus.

While a step runs its agent reads what was appended to the file every POLL_S, complete
lines only (a line still being written waits for its newline), at most READ_BYTES at a
time, and publishes the points as `metric_points` messages of at most BATCH points on
`m27.metrics.<run>.<step>.node-<node>` (stream M27_METRICS), and of at most
BATCH_BYTES of lines. Each message's id is the
attempt and the file offset of its first line, so a message published twice (a retry
after a lost ack) is stored once. When the step ends the rest of the file is read and
published before its `task_exited`, so a finished step's series is complete. Lines that
are not metrics (`m27.common.metric_points.parse_line`) are skipped and counted; the
agent logs the first problem of each file, never the line itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from m27.common.events import MetricPoint
from m27.common.metric_points import MAX_LINE_BYTES, parse_line

POLL_S: Final = 0.5
READ_BYTES: Final = 4 * 1024 * 1024
BATCH: Final = 2000
#: Lines per message are also capped by their bytes, so a message stays far below NATS's
#: 1 MiB payload limit whatever the lines hold.
BATCH_BYTES: Final = 256 * 1024


@dataclass
class Chunk:
    """Points read from one place in the file, in order."""

    offset: int  # of the first line read
    points: list[MetricPoint] = field(default_factory=list)
    size: int = 0  # bytes of the lines read


@dataclass
class MetricsFile:
    """The read position in one attempt's metrics file and what was skipped so far."""

    path: Path
    offset: int = 0
    skipped: int = 0
    first_problem: str = ""
    checked: int = 0  # problems before this offset are counted already
    truncations: int = 0  # times the program truncated the file (reading started over)

    def read(self, now: float, limit: int = READ_BYTES) -> tuple[list[Chunk], int]:
        """The points appended since `offset`, in chunks of at most BATCH, each with the
        offset it starts at, and the offset after them: the caller moves `offset` there
        once they are published (so points are never lost to a failed publish). A
        missing file is no points (the program logs nothing)."""
        try:
            with self.path.open("rb") as file:
                if os.fstat(file.fileno()).st_size < self.offset:
                    self.offset = self.checked = 0  # the program truncated it: start over
                    self.truncations += 1
                file.seek(self.offset)
                data = file.read(limit)
        except FileNotFoundError:
            return [], self.offset
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) > MAX_LINE_BYTES:  # no newline in sight: skip what is there
                self._problem(self.offset, f"a line longer than {MAX_LINE_BYTES // 1024} KiB")
                return [], self.offset + len(data)
            return [], self.offset
        chunks: list[Chunk] = []
        position = self.offset
        for line in data[:end].split(b"\n"):
            start, position = position, position + len(line) + 1
            if not line.strip():
                continue
            got = parse_line(line.rstrip(b"\r"), now)
            if isinstance(got, str):
                self._problem(start, got)
                continue
            if not chunks or len(chunks[-1].points) >= BATCH or chunks[-1].size >= BATCH_BYTES:
                chunks.append(Chunk(offset=start))
            chunks[-1].points.append(got)
            chunks[-1].size += len(line) + 1
        return chunks, position

    def _problem(self, at: int, problem: str) -> None:
        if at >= self.checked:  # counted once, however often the same bytes are read
            self.skipped += 1
            self.checked = at + 1
            self.first_problem = self.first_problem or f"byte {at}: {problem}"
