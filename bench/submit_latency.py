"""How long from submitting a pipeline until its first step runs: a one-step pipeline
submitted N times over gRPC to the embedded system (orchestrator → scheduler → node-agent),
against starting the same command with `subprocess.Popen` in this process (the baseline), in
the same run on the same machine.

    python bench/submit_latency.py [--runs 30] [--json]

Two m27 figures per submission: until the node-agent had started the process (the step's
`started_at`, the moment the baseline's `Popen` returns), and until a watcher of the run
saw the step `running` (what `m27 watch` shows). Submissions go one at a time, each after
the previous run finished, with the result cache off so every step really starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _embedded import temporary_system

from m27.client import Client, RunEvent
from m27.common.model import RunRecord

COMMAND = "true"
PIPELINE = f"name: latency\npipeline:\n  - name: only\n    command: {COMMAND}\n"


def p95(values: list[float]) -> float:
    """Nearest rank: the smallest value at least 95 % of the values do not exceed."""
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


def popen_start(workdir: Path) -> float:
    """Seconds for Popen to start `/bin/sh -c COMMAND` as the node-agent does (own
    session, stdin from /dev/null, output to files); then waits for it to end."""
    with (workdir / "out").open("wb") as out, (workdir / "err").open("wb") as err:
        began = time.perf_counter()
        process = subprocess.Popen(["/bin/sh", "-c", COMMAND], cwd=workdir,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                   start_new_session=True)
        took = time.perf_counter() - began
        process.wait()
    return took


def _running(item: RunRecord | RunEvent) -> bool:
    if isinstance(item, RunEvent):
        return item.type == "step_state_changed" and item.state == "running"
    return any(s.state not in ("pending", "queued") for s in item.steps)


async def submit_once(client: Client, workdir: Path) -> tuple[float, float, bool]:
    """(seconds until started_at, seconds until a watcher saw `running`, whether it was
    first seen in the watch's snapshot rather than as an event)."""
    wall, began = time.time(), time.perf_counter()
    run_id = await client.submit(PIPELINE, workdir=str(workdir), no_cache=True)
    seen: float | None = None
    in_snapshot = False
    async for item in client.watch(run_id):
        if seen is None and _running(item):
            seen, in_snapshot = time.perf_counter() - began, isinstance(item, RunRecord)
        if isinstance(item, RunEvent) and item.final:
            break
    run = await client.get_run(run_id)
    step = run.steps[0]
    if run.state != "succeeded" or step.started_at is None or step.cached_from or seen is None:
        raise SystemExit(f"benchmark run {run_id} ended {run.state}; step {step.state}")
    return step.started_at - wall, seen, in_snapshot


async def through_m27(api: str, runs: int, workdir: Path) -> list[tuple[float, float, bool]]:
    async with Client(api) as client:
        await client.wait_ready()
        await submit_once(client, workdir)  # warm-up: connections, first scheduling pass
        return [await submit_once(client, workdir) for _ in range(runs)]


def summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(values) * 1e3, "p95_ms": p95(values) * 1e3}


def measure(runs: int) -> dict[str, object]:
    with temporary_system() as (state, _home, work):
        direct = [popen_start(work) for _ in range(runs)]
        m27 = asyncio.run(through_m27(state.api, runs, work))
    return {
        "runs": runs, "command": COMMAND, "machine": platform.platform(),
        "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "popen": summary(direct),
        "m27_started": summary([started for started, _, _ in m27]),
        "m27_watcher_saw_running": summary([seen for _, seen, _ in m27]),
        "first_seen_in_snapshot": sum(1 for _, _, snap in m27 if snap),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.runs)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"one-step pipeline (`{COMMAND}`), {args.runs} submissions, one at a time:")
    for key, label in (("popen", "subprocess.Popen directly"),
                       ("m27_started", "submit → process started"),
                       ("m27_watcher_saw_running", "submit → watcher sees running")):
        figures = result[key]
        assert isinstance(figures, dict)
        print(f"  {label:<32} median {figures['median_ms']:7.1f} ms   "
              f"p95 {figures['p95_ms']:7.1f} ms")
    print(f"  ({result['first_seen_in_snapshot']} of {args.runs} were already running when "
          "the watch began, so were seen in its snapshot)")


if __name__ == "__main__":
    main()
