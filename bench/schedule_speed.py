"""Decision speed: one scheduling cycle with 10,000 pending tasks on 1,000 nodes x 8 GPUs.

Times `decide()` (m27's policy: scores, fragmentation-aware packing, wait reasons, ready
pool) on an empty simulated cluster (simulated GPUs, no hardware involved) and a seeded
mix of fractional, whole-GPU, multi-GPU and CPU-only tasks, and reports the cycle time
and placements per second. The old best-fit `schedule()` runs on the same tasks in the
same process as the baseline.

    .venv/bin/python bench/schedule_speed.py [--tasks 10000 --nodes 1000 --gpus 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from m27.common.events import EnqueueTask
from m27.common.model import GpuInfo, Resources
from m27.scheduler import policy
from m27.scheduler.model import ClusterState, Gpu, Job, Node, Place, Queued, Wait

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


def old_inputs(state: ClusterState, queue: Sequence[Queued]) -> tuple[
        list[policy.Node], list[policy.QueuedTask]]:
    """The same cluster and tasks in the old policy's shapes (tenths, CPU slots)."""
    nodes = [policy.Node(
        node_id=n.node_id, cpu_slots=n.cpu_milli // 1000, last_heartbeat=0.0,
        gpus=tuple(GpuInfo(index=g.index, name="sim", uuid=f"{n.node_id}-{g.index}",
                           memory_total_mb=g.memory_mb, simulated=True) for g in n.gpus))
        for n in state.nodes]
    queue_old = [policy.QueuedTask(queued_at=q.queued_at, task=EnqueueTask(
        at=q.queued_at, task_id=q.job.task_id, run_id="r", step=q.job.task_id, attempt=1,
        step_type="gpu" if q.job.gpu_milli >= 1000 else "gpu_light" if q.job.gpu_milli
        else "cpu", urgency=q.job.urgency, user=q.job.user, command="x",
        resources=Resources(gpus=q.job.gpu_milli / 1000, cpus=q.job.cpu_milli // 1000)))
        for q in queue]
    return nodes, queue_old


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
    nodes_old, queue_old = old_inputs(state, queue)
    start = time.perf_counter()
    old = policy.schedule(nodes_old, [], queue_old)
    old_s = time.perf_counter() - start
    old_placed = sum(isinstance(d, policy.Place) for d in old)
    print(f"{args.tasks} pending tasks, {args.nodes} nodes x {args.gpus} simulated GPUs\n")
    print("| policy | cycle time (s) | placed | waiting | placements/s |")
    print("|---|---|---|---|---|")
    print(f"| m27 decide() | {m27_s:.2f} | {placed} | {waiting} | {placed / m27_s:,.0f} |")
    print(f"| old best-fit schedule() (baseline) | {old_s:.2f} | {old_placed} | "
          f"{len(old) - old_placed} | {old_placed / old_s:,.0f} |")
    print(f"\nm27 / baseline placements/s: {(placed / m27_s) / (old_placed / old_s):.2f}x; "
          f"decisions per second (all kinds): {len(decisions) / m27_s:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
