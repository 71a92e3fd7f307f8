"""What m27 adds to a pipeline's wall time: a chain of N trivial steps, run through the whole
embedded system (gRPC submit → orchestrator → scheduler → node-agent → events → done) versus
the same commands run one after another with /bin/sh in this process (the baseline), in the
same run on the same machine.

    python bench/pipeline_overhead.py [--steps 20] [--repeat 3] [--json]

Prints the per-step overhead and the ratio; docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _embedded import temporary_system

from m27.client import Client

COMMAND = "true"


def chain(steps: int) -> str:
    lines = ["pipeline:"]
    for i in range(steps):
        lines.append(f"  - name: s{i}")
        lines.append(f"    command: {COMMAND}")
        if i:
            lines.append(f"    depends_on: [s{i - 1}]")
    return "\n".join(lines) + "\n"


def baseline(steps: int, workdir: Path) -> float:
    """Seconds to run the chain directly: one /bin/sh -c per step, in order."""
    began = time.perf_counter()
    for _ in range(steps):
        subprocess.run(["/bin/sh", "-c", COMMAND], cwd=workdir, check=True)
    return time.perf_counter() - began


async def through_m27(api: str, steps: int, workdir: Path) -> float:
    """Seconds from SubmitPipeline until the run's final event reaches a watcher."""
    async with Client(api) as client:
        began = time.perf_counter()
        run_id = await client.submit(chain(steps), workdir=str(workdir))
        async for item in client.watch(run_id):
            if getattr(item, "final", False):
                break
        elapsed = time.perf_counter() - began
        run = await client.get_run(run_id)
        if run.state != "succeeded":
            raise SystemExit(f"benchmark run {run_id} ended {run.state}")
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with temporary_system() as (state, _home, work):
        direct = [baseline(args.steps, work) for _ in range(args.repeat)]
        m27 = [asyncio.run(through_m27(state.api, args.steps, work))
               for _ in range(args.repeat)]
    result = {
        "steps": args.steps, "repeat": args.repeat, "machine": platform.platform(),
        "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "baseline_s": statistics.median(direct), "m27_s": statistics.median(m27),
    }
    result["ratio"] = result["m27_s"] / result["baseline_s"]
    result["overhead_per_step_ms"] = (result["m27_s"] - result["baseline_s"]) / args.steps * 1e3
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.steps}-step chain, median of {args.repeat}:")
    print(f"  direct /bin/sh  {result['baseline_s']:.3f}s")
    print(f"  through m27     {result['m27_s']:.3f}s  ({result['ratio']:.1f}x)")
    print(f"  m27 overhead    {result['overhead_per_step_ms']:.1f} ms per step "
          "(submit, state in KV, scheduling, start, exit report, release of the next step)")


if __name__ == "__main__":
    main()
