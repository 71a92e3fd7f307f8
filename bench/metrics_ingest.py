"""Metric ingestion on one node: how many points per second a step's `m27.train.log`
calls reach JetStream (stream M27_METRICS) through its node-agent, on the embedded system
(`m27 up`, authenticated bus, `sync_interval: always`), against the rate at which the
same step writes them to its metrics file alone (the baseline, measured in the same run:
ingestion cannot be faster than the program logs).

    python bench/metrics_ingest.py [--points 300000] [--metrics 4] [--json]

The step logs `--points` training steps of `--metrics` scalars each as fast as it can and
records when it started and finished (wall clock). Ingestion is points / (time the last
batch was stored − time the first point was logged), read from the stream's own
timestamps; every point is checked to arrive exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

from _embedded import temporary_system

from m27.client import Client
from m27.common import events, subjects
from m27.common.bus import connect
from m27.common.config import NatsSection
from m27.common.principals import principal
from m27.embedded import system

STEP = """\
import json, sys, time
import m27.train
points, metrics = int(sys.argv[1]), int(sys.argv[2])
names = [f"m{i}" for i in range(metrics)]
began = time.time()
for step in range(points):
    m27.train.log(step, **{n: step * 0.001 for n in names})
logged = time.time()
m27.train.flush_metrics(60)
written = time.time()
json.dump({"began": began, "logged": logged, "written": written}, open(sys.argv[3], "w"))
"""


async def collect(home: Path, url: str, run_id: str, expected: int,
                  timeout: float) -> tuple[int, float, int]:
    """(points stored, timestamp of the last batch stored, duplicate points)."""
    nc = await connect(url, name="bench-metrics",
                       access=system.access(home, principal("admin"), NatsSection()))
    try:
        js = nc.jetstream(timeout=10)
        sub = await js.subscribe(f"{subjects.PREFIX}.metrics.{run_id}.>",
                                 ordered_consumer=True)
        seen: set[int] = set()
        duplicates, last = 0, 0.0
        deadline = time.monotonic() + timeout
        while len(seen) < expected and time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=5)
            except TimeoutError:
                continue
            batch = events.decode_metrics(msg.data)
            for point in batch.points:
                duplicates += point.step in seen
                seen.add(point.step)
            last = max(last, msg.metadata.timestamp.timestamp())
        return len(seen), last, duplicates
    finally:
        await nc.close()


async def run(home: Path, url: str, api: str, work: Path, points: int,
              metrics: int) -> dict[str, float | int]:
    script, times = work / "step.py", work / "times.json"
    script.write_text(STEP)
    command = f"{sys.executable} {script} {points} {metrics} {times}"
    async with Client(api) as client:
        run_id = await client.submit(f"pipeline:\n  - name: log\n    command: {command}\n",
                                     workdir=str(work), no_cache=True)
        stored, last, duplicates = await collect(home, url, run_id, points, timeout=600)
        run = await client.get_run(run_id)
    if run.state not in ("running", "succeeded") or not times.exists():
        raise SystemExit(f"benchmark step ended {run.state}: {run.steps[0].stderr_tail}")
    marks = json.loads(times.read_text())
    return {
        "points": points, "metrics_per_point": metrics, "stored": stored,
        "duplicates": duplicates,
        "baseline_points_per_s": points / (marks["written"] - marks["began"]),
        "ingested_points_per_s": stored / (last - marks["began"]),
        "behind_the_program_s": last - marks["written"],
    }


def measure(points: int, metrics: int) -> dict[str, object]:
    with temporary_system() as (state, home, work):
        result = asyncio.run(run(home, state.nats_url, state.api, work, points, metrics))
    return {"machine": platform.platform(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=300_000)
    parser.add_argument("--metrics", type=int, default=4, help="scalars per point")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.points, args.metrics)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['points']} points of {result['metrics_per_point']} scalars, one step:")
    print(f"  the step logging them to its file   {result['baseline_points_per_s']:10,.0f} "
          "points/s (baseline)")
    print(f"  logged → stored in M27_METRICS      {result['ingested_points_per_s']:10,.0f} "
          f"points/s ({result['stored']} stored, {result['duplicates']} duplicates, "
          f"last {result['behind_the_program_s']:.2f} s after the step's last write)")


if __name__ == "__main__":
    main()
