"""The dashboard's query on the report service's history (`m27.report.store`): every GPU
of a cluster over a span, downsampled for display, answered from the rollups kept at
insert time, against the same answer computed from the raw samples (the baseline, in the
same run on the same file).

    python bench/history_query.py [--gpus 1000] [--hours 24] [--points 120] [--json]

The store is filled first with `--gpus` GPUs (8 per node) × `--hours` of 5 s samples, in
transactions of 100 heartbeats per node (what a consumer fetching a batch writes), and
the fill rate is reported too. Each query figure is the median of 5 runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from m27.common.model import GpuSample
from m27.report.store import History

GPUS_PER_NODE = 8
INTERVAL_S = 5.0
BEATS_PER_TRANSACTION = 100


def fill(history: History, gpus: int, hours: float, start: float) -> tuple[int, float]:
    """(samples written, seconds it took)."""
    rng = random.Random(0)
    nodes = [f"node-{n:04d}" for n in range((gpus + GPUS_PER_NODE - 1) // GPUS_PER_NODE)]
    beats = int(hours * 3600 / INTERVAL_S)
    began = time.perf_counter()
    written = 0
    for first in range(0, beats, BEATS_PER_TRANSACTION):
        batch = []
        for node_index, node in enumerate(nodes):
            count = min(GPUS_PER_NODE, gpus - node_index * GPUS_PER_NODE)
            for beat in range(first, min(first + BEATS_PER_TRANSACTION, beats)):
                batch.append((node, start + beat * INTERVAL_S, [
                    GpuSample(index=g, utilization_pct=rng.uniform(0, 100),
                              memory_used_mb=rng.randrange(0, 81920), temperature_c=60.0,
                              power_w=300.0, memory_total_mb=81920)
                    for g in range(count)]))
        history.add_heartbeats(batch)
        written += sum(len(samples) for _, _, samples in batch)
    return written, time.perf_counter() - began


def timed(query: Callable[[], object], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        query()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(gpus: int, hours: float, points: int) -> dict[str, Any]:
    start = 1_764_547_200.0  # 2025-12-01 00:00 UTC, on every rollup's grid
    until = start + hours * 3600
    with tempfile.TemporaryDirectory(prefix="m27-bench-") as tmp:
        history = History(Path(tmp) / "history.sqlite")
        written, fill_s = fill(history, gpus, hours, start)
        answer = history.gpu_history(start, until, points)
        rollups = timed(lambda: history.gpu_history(start, until, points))
        last_hour = timed(lambda: history.gpu_history(until - 3600, until, points))
        raw = timed(lambda: history.gpu_history_from_raw(start, until, points), runs=1)
        size = (Path(tmp) / "history.sqlite").stat().st_size
        history.close()
    return {
        "machine": platform.platform(), "cpus": os.cpu_count(),
        "python": sys.version.split()[0], "gpus": gpus, "hours": hours, "samples": written,
        "fill_samples_per_s": written / fill_s, "file_mib": size / 2**20,
        "series": len(answer), "points_per_series": max(len(v) for v in answer.values()),
        "query_s": rollups, "last_hour_query_s": last_hour, "raw_query_s": raw,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--points", type=int, default=120, help="display buckets per GPU")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.gpus, args.hours, args.points)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['gpus']} GPUs × {result['hours']} h of 5 s samples "
          f"({result['samples']:,} rows, {result['file_mib']:.0f} MiB), filled at "
          f"{result['fill_samples_per_s']:,.0f} samples/s")
    print(f"  every GPU, the whole span, ≤ {args.points} points each: "
          f"{result['query_s'] * 1e3:.0f} ms from rollups, "
          f"{result['raw_query_s'] * 1e3:.0f} ms from the raw samples (baseline)")
    print(f"  every GPU, the last hour: {result['last_hour_query_s'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
