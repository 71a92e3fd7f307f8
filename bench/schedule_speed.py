"""Decision speed: one scheduling cycle with 10,000 pending tasks on 1,000 nodes x 8 GPUs.

Times `decide()` (m27's policy: scores, fragmentation-aware packing, wait reasons, ready
pool) on an empty simulated cluster (simulated GPUs, no hardware involved) and a seeded
mix of fractional, whole-GPU, multi-GPU and CPU-only tasks, and reports the cycle time
and placements per second. The baseline is best-fit packing (`m27.sim.best_fit`, the
simulator's tightest-fit policy: no scores, no wait reasons, no ready pool), run on the same
cluster and tasks in the same process.

    .venv/bin/python bench/schedule_speed.py [--tasks 10000 --nodes 1000 --gpus 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from m27.scheduler import policy
from m27.scheduler.model import ClusterState, Gpu, Job, Node, Place, Queued, Wait
from m27.sim import best_fit

GPU_MILLI = (0, 100, 200, 300, 500, 700, 1000, 1000, 1000, 2000, 4000, 8000)
URGENCY = ("low", "normal", "normal", "high", "urgent")


def cluster(nodes: int, gpus: int) -> ClusterState:
    return ClusterState(running=(), nodes=tuple(
        Node(node_id=f"n{i:04d}", cpu_milli=128_000, memory_mb=1_024_000,
             gpus=tuple(Gpu(index=g, memory_mb=81_920, simulated=True) for g in range(gpus)))
        for i in range(nodes)))


def tasks(count: int, seed: int) -> list[Queued]:
    rng = np.random.default_rng(seed)
    milli = rng.choice(GPU_MILLI, count)
    cpu = rng.choice((1000, 2000, 4000, 8000), count)
    urgency = rng.choice(URGENCY, count)
    return [Queued(job=Job(task_id=f"t{i:05d}", gpu_milli=int(milli[i]), cpu_milli=int(cpu[i]),
                           memory_mb=4096, urgency=urgency[i], user=f"u{i % 37}"),
                   queued_at=float(rng.uniform(0, 3600))) for i in range(count)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    state, queue = cluster(args.nodes, args.gpus), tasks(args.tasks, args.seed)
    start = time.perf_counter()
    decisions = policy.decide(state, queue, 3600.0)
    m27_s = time.perf_counter() - start
    placed = sum(isinstance(d, Place) for d in decisions)
    waiting = sum(isinstance(d, Wait) for d in decisions)
    start = time.perf_counter()
    base = best_fit(state, queue, 3600.0)
    base_s = time.perf_counter() - start
    base_placed = sum(isinstance(d, Place) for d in base)
    print(f"{args.tasks} pending tasks, {args.nodes} nodes x {args.gpus} simulated GPUs\n")
    print("| policy | cycle time (s) | placed | waiting | placements/s |")
    print("|---|---|---|---|---|")
    print(f"| m27 decide() | {m27_s:.2f} | {placed} | {waiting} | {placed / m27_s:,.0f} |")
    print(f"| best-fit packing (baseline) | {base_s:.2f} | {base_placed} | "
          f"{len(base) - base_placed} | {base_placed / base_s:,.0f} |")
    print(f"\nm27 / baseline placements/s: {(placed / m27_s) / (base_placed / base_s):.2f}x; "
          f"decisions per second (all kinds): {len(decisions) / m27_s:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
