"""`m27.train.log(step, **scalars)`: training metrics, without slowing the training loop.

A call checks its arguments and appends the point to a buffer under a lock (about a
microsecond); a daemon thread writes the buffer as JSON lines (`m27.common.metric_points`
has the format) to `$M27_METRICS_FILE`, which the node-agent sets for every step and
tails onto the bus. It writes at least every FLUSH_S and at exit (`flush()` forces it).
Outside m27 nothing is written unless `log_to(path)` names a file. The buffer is bounded:
past MAX_PENDING points not yet written (a stalled disk) new points are dropped and
counted, never blocking the caller.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Final

from m27.common.metric_points import metric_problem
from m27.train._log import TrainLog

ENV: Final = "M27_METRICS_FILE"
FLUSH_S: Final = 0.25
MAX_PENDING: Final = 1_000_000

log_ = TrainLog()


class MetricWriter:
    """Points buffered in memory, written to `path` by a thread of its own."""

    def __init__(self, path: Path, flush_s: float = FLUSH_S,
                 max_pending: int = MAX_PENDING) -> None:
        self.path = path
        self.flush_s = flush_s
        self.max_pending = max_pending
        self.dropped = 0
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._written = threading.Condition(self._lock)
        self._generation = 0  # buffers taken by the thread so far
        self._done = 0  # ... and written
        self._closed = False
        self._failed = ""
        self._thread = threading.Thread(target=self._run, name="m27-metrics", daemon=True)
        self._thread.start()

    def add(self, line: str) -> None:
        with self._lock:
            if len(self._lines) >= self.max_pending:
                self.dropped += 1
                if self.dropped == 1:
                    log_.warning("metrics.dropping", pending=len(self._lines),
                                 path=str(self.path))
                return
            self._lines.append(line)

    def flush(self, timeout: float = 5.0) -> bool:
        """Write what is buffered now; False when it was not written within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self._generation + 1
            self._wake.notify()
            while self._done < target and not self._failed:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._written.wait(left)
            return not self._failed

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._wake.notify()

    def _run(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            self._fail(exc)
            return
        try:
            while True:
                with self._lock:
                    if not self._lines and not self._closed:
                        self._wake.wait(self.flush_s)
                    lines, self._lines = self._lines, []
                    self._generation += 1
                    generation, closed = self._generation, self._closed
                data = "".join(lines).encode()
                while data:
                    data = data[os.write(fd, data):]
                with self._lock:
                    self._done = generation
                    self._written.notify_all()
                if closed:
                    return
        except OSError as exc:
            self._fail(exc)
        finally:
            os.close(fd)

    def _fail(self, exc: OSError) -> None:
        log_.warning("metrics.write_failed", path=str(self.path), error=str(exc))
        with self._lock:
            self._failed = str(exc)
            self._written.notify_all()


_writer: MetricWriter | None = None
_writer_lock = threading.Lock()
_configured = False


def _current() -> MetricWriter | None:
    global _writer, _configured
    if _configured:
        return _writer
    with _writer_lock:
        if not _configured:
            path = os.environ.get(ENV, "")
            _writer = MetricWriter(Path(path)) if path else None
            if _writer is not None:
                atexit.register(_writer.close)
            _configured = True
    return _writer


def log_to(path: str | os.PathLike[str]) -> None:
    """Write metrics to `path` (outside m27, or instead of `$M27_METRICS_FILE`)."""
    global _writer, _configured
    with _writer_lock:
        if _writer is not None:
            _writer.close()
        _writer = MetricWriter(Path(path))
        atexit.register(_writer.close)
        _configured = True


def log(step: int, **scalars: float) -> None:
    """Record the scalars of training step `step` (an integer ≥ 0), e.g.
    `m27.train.log(120, loss=0.41, acc=0.83)`. Numbers of any kind (a float, an int, a
    numpy or 0-d torch scalar); NaN and infinities are kept. ValueError names a bad step,
    metric name or value. A no-op outside m27 unless `log_to` named a file."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"m27.train.log: step must be an integer ≥ 0, got {step!r}")
    if not scalars:
        raise ValueError("m27.train.log: give at least one metric, e.g. loss=0.41")
    values: dict[str, float] = {}  # json writes NaN and Infinity as the file format has them
    for name, value in scalars.items():
        try:
            number = float(value) if not isinstance(value, bool) else value
        except (TypeError, ValueError):
            number = value
        problem = metric_problem(name, number)
        if problem:
            raise ValueError(f"m27.train.log: {problem}")
        values[name] = float(number)
    writer = _current()
    if writer is None:
        return
    line = json.dumps({"step": step, "t": round(time.time(), 6), **values},
                      separators=(",", ":"))
    writer.add(line + "\n")


def log_work(step: int, **totals: float) -> None:
    """Record the work done so far, as cumulative totals by unit:
    `m27.train.log_work(120, flops=3.1e15, samples=15360)`. They are metrics named
    `work.<unit>`; the report and `m27 compare` divide a step's total by its GPU energy
    (docs/training.md, "Work per joule"). ValueError for a negative or non-finite total."""
    if not totals:
        raise ValueError("m27.train.log_work: give at least one total, e.g. flops=3.1e15")
    numbers: dict[str, float] = {}
    for unit, total in totals.items():
        try:  # a float, an int, a numpy or 0-d torch scalar
            number = math.nan if isinstance(total, bool) else float(total)
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"m27.train.log_work: {unit} must be a finite total ≥ 0, got "
                             f"{total!r}")
        numbers[f"work.{unit}"] = number
    log(step, **numbers)


def flush(timeout: float = 5.0) -> bool:
    """Write every point logged so far now (before a step ends on its own terms, say);
    False when it could not be written within `timeout`. True outside m27."""
    writer = _current()
    return True if writer is None else writer.flush(timeout)
