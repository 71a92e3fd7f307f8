"""The report service's embedded history: training metrics and per-GPU samples in SQLite,
materialised from the streams (M27_METRICS, M27_TELEMETRY, M27_EVENTS), which stay the
source of truth: each write is stored with the stream position it came from (`positions`,
in the same transaction), so a copy reads on from exactly there, and a lost file is
rebuilt by reading the streams again from their start (`report.replica`).

Why SQLite (docs/architecture.md, "History"): it ships with Python (no new dependency,
nothing to run), one file under `$M27_HOME`, WAL lets the dashboard read while the consumer
writes, and every query here is a range scan on a primary key. The one query that would
be slow on raw rows, a day of 5 s samples of a whole cluster (17 million rows for 1,000
GPUs), reads rollups kept at insert time instead: per GPU and minute, and per GPU and ten
minutes (count, sums and maxima), so any span is answered from at most a few hundred
thousand rows, then averaged into at most `max_points` buckets per GPU.

Writes are idempotent (a redelivered message changes nothing): a metric point is keyed by
run, step, attempt, training step and name; a GPU sample by node, GPU and time, and a
rollup only counts a sample its raw table did not have yet. Who held a GPU is kept as one
span per task attempt and GPU (first and last reading that showed it there), so "the GPUs
this step held over its attempts" is an index lookup, not a scan of samples. Each task's
committed checkpoints and training anomalies (from its task events) are what the run
report marks on its timeline.
"""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from m27.common.curves import DEFAULT_POINTS, Curve, summarize
from m27.common.events import (
    CheckpointCommitted,
    GpuTelemetry,
    MetricPoint,
    MetricPoints,
    TrainingAnomaly,
)
from m27.common.model import GpuSample, per_gpu_share

#: (source, stream sequence): the message a write came from, stored with it (`positions`).
Applied = tuple[str, int]

#: Rollup tables and their bucket widths (seconds), finest first.
ROLLUPS: Final = (("gpu_1m", 60), ("gpu_10m", 600))
RAW_INTERVAL_S: Final = 5.0
NOT_FINITE: Final = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL, step TEXT NOT NULL, attempt INTEGER NOT NULL,
    tstep INTEGER NOT NULL, name TEXT NOT NULL, at REAL NOT NULL, value REAL,
    PRIMARY KEY (run_id, step, name, attempt, tstep)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gpu (
    node_id TEXT NOT NULL, gpu INTEGER NOT NULL, at REAL NOT NULL,
    util REAL NOT NULL, mem_used INTEGER NOT NULL, mem_total INTEGER NOT NULL,
    temp REAL NOT NULL, power REAL, throttle TEXT NOT NULL,
    PRIMARY KEY (node_id, gpu, at)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS gpu_at ON gpu (at);
CREATE TABLE IF NOT EXISTS holding (
    task_id TEXT NOT NULL, attempt INTEGER NOT NULL, node_id TEXT NOT NULL,
    gpu INTEGER NOT NULL, share REAL NOT NULL, first_at REAL NOT NULL, last_at REAL NOT NULL,
    PRIMARY KEY (task_id, attempt, node_id, gpu)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS holding_gpu ON holding (node_id, gpu, last_at);
CREATE TABLE IF NOT EXISTS checkpoints (
    task_id TEXT NOT NULL, checkpoint_id TEXT NOT NULL, attempt INTEGER NOT NULL,
    at REAL NOT NULL, tstep INTEGER, size INTEGER NOT NULL, new_bytes INTEGER NOT NULL,
    PRIMARY KEY (task_id, checkpoint_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS anomalies (
    task_id TEXT NOT NULL, attempt INTEGER NOT NULL, metric TEXT NOT NULL,
    tstep INTEGER NOT NULL, kind TEXT NOT NULL, at REAL NOT NULL, value REAL,
    baseline REAL, actions TEXT NOT NULL,
    PRIMARY KEY (task_id, attempt, metric, tstep, kind)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS positions (
    source TEXT PRIMARY KEY, sequence INTEGER NOT NULL) WITHOUT ROWID;
"""
#: One metric of one step: a point is left out when a later attempt began at or before it.
_SERIES: Final = """
WITH starts AS (
    SELECT attempt, min(tstep) AS first FROM metrics
    WHERE run_id = ?1 AND step = ?2 GROUP BY attempt)
SELECT m.tstep, m.at, m.value FROM metrics m
WHERE m.run_id = ?1 AND m.step = ?2 AND m.name = ?3
  AND NOT EXISTS (SELECT 1 FROM starts s WHERE s.attempt > m.attempt AND s.first <= m.tstep)
ORDER BY m.tstep
"""
_ROLLUP_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS {table} (
    bucket INTEGER NOT NULL, node_id TEXT NOT NULL, gpu INTEGER NOT NULL,
    n INTEGER NOT NULL, util_sum REAL NOT NULL, mem_max INTEGER NOT NULL,
    temp_max REAL NOT NULL, power_sum REAL NOT NULL, power_n INTEGER NOT NULL,
    PRIMARY KEY (bucket, node_id, gpu)) WITHOUT ROWID;
"""


@dataclass(frozen=True, slots=True)
class HeldGpu:
    """One GPU one attempt of a task held, from the first to the last reading that showed
    it there."""

    task_id: str
    attempt: int
    node_id: str
    gpu: int
    share: float  # of this GPU
    first_at: float
    last_at: float


@dataclass(frozen=True, slots=True)
class CheckpointMark:
    """A checkpoint of a task that became visible (`checkpoint_committed`)."""

    checkpoint_id: str
    attempt: int
    at: float
    train_step: int | None
    size_bytes: int
    new_bytes: int


@dataclass(frozen=True, slots=True)
class AnomalyMark:
    """What a step's training monitor saw (`training_anomaly`)."""

    attempt: int
    metric: str
    train_step: int
    kind: str
    at: float
    value: float  # NaN for NaN
    baseline: float | None
    actions: str  # comma-separated


@dataclass(frozen=True, slots=True)
class GpuPoint:
    """A GPU over one display bucket: mean utilisation and power, highest memory and
    temperature (what a chart of the last hours shows)."""

    at: float  # the bucket's start
    utilization_pct: float
    memory_used_mb: int
    temperature_c: float
    power_w: float | None


def _value(raw: float | str) -> float | None:
    """A metric value as stored: NaN as NULL (SQLite has no NaN), infinities as they are."""
    number = NOT_FINITE[raw] if isinstance(raw, str) else float(raw)
    return None if math.isnan(number) else number


class History:
    """One connection, used from any thread but one at a time (`_lock`): the consumer and
    the retention loop write, the dashboard reads."""

    def __init__(self, path: Path | str) -> None:
        self._lock = threading.RLock()
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # the streams are what is durable
        self.db.executescript(_SCHEMA + "".join(_ROLLUP_SCHEMA.format(table=t)
                                                for t, _ in ROLLUPS))

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------ in

    def add_metrics(self, batch: MetricPoints, applied: Applied | None = None) -> None:
        rows = [(batch.run_id, batch.step, batch.attempt, p.step, name, p.at, _value(v))
                for p in batch.points for name, v in p.values.items()]
        with self._transaction(applied):
            self.db.executemany("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?, ?, ?, ?)",
                                rows)

    def add_gpu_samples(self, node_id: str, at: float, samples: Iterable[GpuSample]) -> None:
        """One heartbeat's readings of a node's GPUs, taken at `at`."""
        self.add_heartbeats([(node_id, at, samples)])

    def add_heartbeats(self, beats: Iterable[tuple[str, float, Iterable[GpuSample]]]) -> None:
        """Several heartbeats' readings (node, time, samples) in one transaction."""
        with self._transaction():
            self._insert_samples(beats)

    def _insert_samples(self, beats: Iterable[tuple[str, float, Iterable[GpuSample]]]
                        ) -> None:
        rows = [(node_id, s.index, at, s.utilization_pct, s.memory_used_mb,
                 s.memory_total_mb, s.temperature_c, s.power_w, ",".join(s.throttle))
                for node_id, at, samples in beats for s in samples]
        fresh = []
        for row in rows:
            cursor = self.db.execute(
                "INSERT OR IGNORE INTO gpu VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            if cursor.rowcount:
                fresh.append(row)
        for table, width in ROLLUPS:
            self.db.executemany(
                f"INSERT INTO {table} VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?) "  # noqa: S608
                "ON CONFLICT (bucket, node_id, gpu) DO UPDATE SET n = n + 1, "
                "util_sum = util_sum + excluded.util_sum, "
                "mem_max = max(mem_max, excluded.mem_max), "
                "temp_max = max(temp_max, excluded.temp_max), "
                "power_sum = power_sum + excluded.power_sum, "
                "power_n = power_n + excluded.power_n",
                [(int(r[2] // width), r[0], r[1], r[3], r[4], r[6], r[7] or 0.0,
                  int(r[7] is not None)) for r in fresh])

    def add_telemetry(self, readings: Iterable[GpuTelemetry],
                      applied: Applied | None = None) -> None:
        """Nodes' heartbeat readings (the telemetry stream): the samples, and who held
        which GPU (each holding's span widened to this reading), in one transaction."""
        readings = list(readings)
        spans = [(h.task_id, h.attempt, r.node_id, gpu, per_gpu_share(h.gpu_ids, h.gpu_share),
                  r.at, r.at)
                 for r in readings for h in r.tasks for gpu in h.gpu_ids]
        with self._transaction(applied):
            self._insert_samples([(r.node_id, r.at, r.gpus) for r in readings])
            self.db.executemany(
                "INSERT INTO holding VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (task_id, attempt, node_id, gpu) DO UPDATE SET "
                "first_at = min(first_at, excluded.first_at), "
                "last_at = max(last_at, excluded.last_at)", spans)

    def add_checkpoint(self, event: CheckpointCommitted,
                       applied: Applied | None = None) -> None:
        with self._transaction(applied):
            self.db.execute("INSERT OR IGNORE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (event.task_id, event.checkpoint_id, event.attempt, event.at,
                             event.step, event.size_bytes, event.new_bytes))

    def add_anomaly(self, event: TrainingAnomaly, applied: Applied | None = None) -> None:
        with self._transaction(applied):
            self.db.execute(
                "INSERT OR IGNORE INTO anomalies VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (event.task_id, event.attempt, event.metric, event.train_step, event.kind,
                 event.at, _value(event.value), event.baseline, ",".join(event.actions)))

    # ------------------------------------------------------------ positions

    def position(self, source: str) -> int:
        """The stream sequence to read `source` from next (1: from the start)."""
        with self._lock:
            row = self.db.execute("SELECT sequence FROM positions WHERE source = ?",
                                  (source,)).fetchone()
        return 1 if row is None else int(row[0]) + 1

    def forget_position(self, source: str) -> None:
        """Read `source` from its start again (its stream was made anew)."""
        with self._transaction():
            self.db.execute("DELETE FROM positions WHERE source = ?", (source,))

    def mark(self, applied: Applied) -> None:
        """Record that `source` was read up to this sequence (messages with no effect)."""
        with self._transaction(applied):
            pass

    def prune(self, before: float) -> None:
        """Forget what is older than `before` (retention; the streams keep their own)."""
        with self._transaction():
            self.db.execute("DELETE FROM gpu WHERE at < ?", (before,))
            self.db.execute("DELETE FROM metrics WHERE at < ?", (before,))
            self.db.execute("DELETE FROM holding WHERE last_at < ?", (before,))
            self.db.execute("DELETE FROM checkpoints WHERE at < ?", (before,))
            self.db.execute("DELETE FROM anomalies WHERE at < ?", (before,))
            for table, width in ROLLUPS:
                self.db.execute(f"DELETE FROM {table} WHERE bucket < ?",  # noqa: S608
                                (int(before // width),))

    # ------------------------------------------------------------ out

    def metric_names(self, run_id: str, step: str) -> list[str]:
        with self._lock:
            return [r[0] for r in self.db.execute(
                "SELECT DISTINCT name FROM metrics WHERE run_id = ? AND step = ? "
                "ORDER BY name", (run_id, step))]

    def metric_keys(self, run_id: str) -> list[tuple[str, str]]:
        """Every (step, metric name) the run has points of, sorted."""
        with self._lock:
            return [(r[0], r[1]) for r in self.db.execute(
                "SELECT DISTINCT step, name FROM metrics WHERE run_id = ? "
                "ORDER BY step, name", (run_id,))]

    def metric_arrays(self, run_id: str, step: str, name: str
                      ) -> tuple[list[int], list[float], float]:
        """One series (as `metric_series`) as steps, values (NaN for NaN) and the wall time
        of its last point (0 when it has none)."""
        with self._lock:
            rows = self.db.execute(_SERIES, (run_id, step, name)).fetchall()
        return ([r[0] for r in rows], [math.nan if r[2] is None else r[2] for r in rows],
                rows[-1][1] if rows else 0.0)

    def curves(self, run_id: str, *, steps: Collection[str] = (), names: Collection[str] = (),
               max_points: int = DEFAULT_POINTS, limit: int = 2000) -> list[Curve]:
        """The run's curves (only these steps and names, when given), each summarised over
        every point and thinned to `max_points`; at most `limit` of them."""
        out: list[Curve] = []
        for step, name in self.metric_keys(run_id):
            if (steps and step not in steps) or (names and name not in names):
                continue
            if len(out) == limit:
                break
            xs, ys, last_at = self.metric_arrays(run_id, step, name)
            out.append(summarize(step, name, xs, ys, last_at, max_points))
        return out

    def metric_series(self, run_id: str, step: str, name: str) -> list[MetricPoint]:
        """One metric of one step across its attempts, each training step once: an
        attempt's points replace earlier attempts' from its first logged step on
        (`m27.common.metric_points.series`, here in SQL)."""
        with self._lock:
            rows = self.db.execute(_SERIES, (run_id, step, name)).fetchall()
        return [MetricPoint(step=tstep, at=at, values={name: "NaN" if v is None else v})
                for tstep, at, v in rows]

    def held_gpus(self, task_id: str) -> list[HeldGpu]:
        """The GPUs a task held, attempt by attempt (the report's per-step GPU curves read
        each one's samples over its span)."""
        with self._lock:
            rows = self.db.execute(
                "SELECT task_id, attempt, node_id, gpu, share, first_at, last_at FROM holding "
                "WHERE task_id = ? ORDER BY attempt, first_at, node_id, gpu",
                (task_id,)).fetchall()
        return [HeldGpu(*row) for row in rows]

    def checkpoints(self, task_id: str) -> list[CheckpointMark]:
        with self._lock:
            rows = self.db.execute(
                "SELECT checkpoint_id, attempt, at, tstep, size, new_bytes FROM checkpoints "
                "WHERE task_id = ? ORDER BY at, checkpoint_id", (task_id,)).fetchall()
        return [CheckpointMark(*row) for row in rows]

    def anomalies(self, task_id: str) -> list[AnomalyMark]:
        with self._lock:
            rows = self.db.execute(
                "SELECT attempt, metric, tstep, kind, at, value, baseline, actions "
                "FROM anomalies WHERE task_id = ? ORDER BY at, metric", (task_id,)).fetchall()
        return [AnomalyMark(a, m, t, k, at, math.nan if v is None else v, b, acts)
                for a, m, t, k, at, v, b, acts in rows]

    def gpu_trace(self, node_id: str, gpu: int, since: float, until: float,
                  max_points: int = 200) -> list[GpuPoint]:
        """One GPU from `since` to `until`, at most about `max_points` buckets (raw samples:
        a step's span on one GPU is a short range scan of its primary key)."""
        width = max((until - since) / max(max_points, 1), RAW_INTERVAL_S)
        with self._lock:
            rows = self.db.execute(
                "SELECT node_id, gpu, CAST((at - ?3) / ?5 + 1e-9 AS INTEGER) AS i, "
                "count(*), sum(util), max(mem_used), max(temp), total(power), count(power) "
                "FROM gpu WHERE node_id = ?1 AND gpu = ?2 AND at >= ?3 AND at <= ?4 "
                "GROUP BY i ORDER BY i", (node_id, gpu, since, until, width)).fetchall()
        return _points(rows, since, width).get((node_id, gpu), [])

    def holders(self, node_id: str, gpu: int, at: float) -> list[HeldGpu]:
        """Who held one GPU at `at` (by the readings before and after it)."""
        with self._lock:
            rows = self.db.execute(
                "SELECT task_id, attempt, node_id, gpu, share, first_at, last_at FROM holding "
                "WHERE node_id = ? AND gpu = ? AND last_at >= ? AND first_at <= ? "
                "ORDER BY task_id, attempt", (node_id, gpu, at, at)).fetchall()
        return [HeldGpu(*row) for row in rows]

    def gpu_history(self, since: float, until: float, max_points: int = 120
                    ) -> dict[tuple[str, int], list[GpuPoint]]:
        """Every GPU from `since` to `until`, at most about `max_points` buckets each
        (from a rollup: whole rollup buckets, `since` rounded down to one, and as few as
        half as many), from the coarsest table that gives at least half that many (raw
        samples for short spans); the buckets are folded in SQL, so what comes back is no
        bigger than what is shown."""
        span = max(until - since, 1.0)
        width = max(span / max(max_points, 1), RAW_INTERVAL_S)
        # a rollup up to twice as coarse as asked beats reading raw samples (half the
        # points, a fraction of the rows)
        table, table_width = next(((t, w) for t, w in reversed(ROLLUPS) if w <= 2 * width),
                                  ("gpu", 0))
        if table == "gpu":
            return self.gpu_history_from_raw(since, until, max_points)
        width = math.ceil(width / table_width) * table_width  # whole rollup buckets
        since = math.floor(since / table_width) * table_width
        query = (  # `table` is a name from ROLLUPS, never a caller's text
            "SELECT node_id, gpu, "  # noqa: S608
            "CAST((bucket * ?3 - ?1) / ?4 + 1e-9 AS INTEGER) AS i, "
            "sum(n), sum(util_sum), max(mem_max), max(temp_max), sum(power_sum), "
            f"sum(power_n) FROM {table} "
            "WHERE bucket >= CAST(?1 / ?3 AS INTEGER) AND bucket < ?2 "
            "GROUP BY node_id, gpu, i ORDER BY node_id, gpu, i")
        with self._lock:
            rows = self.db.execute(query, (since, math.ceil(until / table_width),
                                           table_width, width)).fetchall()
        return _points(rows, since, width)

    def gpu_history_from_raw(self, since: float, until: float, max_points: int = 120
                             ) -> dict[tuple[str, int], list[GpuPoint]]:
        """What `gpu_history` answers, from the raw samples alone: for spans short enough
        that no rollup is fine enough, and the baseline its benchmark measures them by."""
        width = max((until - since) / max(max_points, 1), RAW_INTERVAL_S)
        with self._lock:
            rows = self.db.execute(
                "SELECT node_id, gpu, CAST((at - ?1) / ?3 + 1e-9 AS INTEGER) AS i, "
                "count(*), sum(util), max(mem_used), max(temp), total(power), count(power) "
                "FROM gpu WHERE at >= ?1 AND at < ?2 "
                "GROUP BY node_id, gpu, i ORDER BY node_id, gpu, i",
                (since, until, width)).fetchall()
        return _points(rows, since, width)

    def _transaction(self, applied: Applied | None = None) -> _Transaction:
        return _Transaction(self.db, self._lock, applied)


class _Transaction:
    """BEGIN … COMMIT under the lock; with `applied`, the source's position is stored in
    the same transaction as the writes (never one without the other)."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock,
                 applied: Applied | None = None) -> None:
        self.db = db
        self.lock = lock
        self.applied = applied

    def __enter__(self) -> None:
        self.lock.acquire()
        self.db.execute("BEGIN")

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            if kind is None and self.applied is not None:
                self.db.execute(
                    "INSERT INTO positions VALUES (?, ?) ON CONFLICT (source) DO UPDATE SET "
                    "sequence = max(sequence, excluded.sequence)", self.applied)
            self.db.execute("COMMIT" if kind is None else "ROLLBACK")
        finally:
            self.lock.release()


def _points(rows: Iterable[tuple[str, int, int, int, float, int, float, float, int]],
            since: float, width: float) -> dict[tuple[str, int], list[GpuPoint]]:
    """Folded rows (node, GPU, bucket index, samples, utilisation sum, memory max,
    temperature max, power sum, power samples), ordered by GPU then bucket, as points."""
    out: dict[tuple[str, int], list[GpuPoint]] = {}
    key: tuple[str, int] | None = None
    points: list[GpuPoint] = []
    for node, gpu, index, n, util, mem, temp, power, power_n in rows:
        if (node, gpu) != key:
            key = (node, gpu)
            points = out.setdefault(key, [])
        points.append(GpuPoint(at=since + index * width, utilization_pct=util / n,
                               memory_used_mb=int(mem), temperature_c=temp,
                               power_w=power / power_n if power_n else None))
    return out
