"""The scheduler service's own cost per cycle: turning its stored records into the policy's
input (`_state.cluster_state` + `queue_of`), against the policy's `decide()` on that input
in the same run (the ratio is the figure; absolute times depend on the machine).

Records are what the service holds: node records of simulated GPUs (no hardware) with a
heartbeat sample per GPU, and task entries, a share of them placed and some idle, paused or
backfilled into a lender.

    .venv/bin/python bench/scheduler_shell.py [--tasks 10000 --nodes 1000 --gpus 8]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from m27.common.events import EnqueueTask
from m27.common.model import GpuInfo, GpuSample, NodeInfo, Resources, Urgency
from m27.scheduler import policy
from m27.scheduler._state import NodeView, Placement, TaskEntry, cluster_state, queue_of

GPUS_ASKED = (0.0, 0.1, 0.2, 0.5, 1.0, 1.0, 2.0)
URGENCIES: tuple[Urgency, ...] = ("low", "normal", "normal", "high", "urgent")


def nodes(count: int, gpus: int) -> list[NodeView]:
    infos = []
    for i in range(count):
        devices = tuple(GpuInfo(index=g, name="m27 simulated GPU", uuid=f"SIM-{i}-{g}",
                                memory_total_mb=81_920, simulated=True) for g in range(gpus))
        samples = tuple(GpuSample(index=g, utilization_pct=40.0, memory_used_mb=1000,
                                  temperature_c=45.0 + g) for g in range(gpus))
        infos.append(NodeView(alive=True, info=NodeInfo(
            node_id=f"n{i:04d}", hostname="h", backend="simulated", gpus=devices,
            cpu_slots=128, registered_at=0.0, last_heartbeat=0.0, samples=samples)))
    return infos


def entries(count: int, node_count: int, placed_share: float, seed: int) -> list[TaskEntry]:
    rng = random.Random(seed)
    made = []
    for i in range(count):
        task = EnqueueTask(at=0.0, task_id=f"r{i}/s", run_id=f"r{i}", step="s", attempt=1,
                           step_type="gpu", resources=Resources(gpus=rng.choice(GPUS_ASKED)),
                           urgency=rng.choice(URGENCIES), user=f"u{i % 40}", command="true",
                           preemptible=rng.random() < 0.3)
        placement = None
        if i < count * placed_share:
            gpus = max(1, round(task.resources.gpus)) if task.resources.gpus else 0
            placement = Placement(task_id=task.task_id, attempt=1,
                                  node_id=f"n{i % node_count:04d}",
                                  gpu_ids=tuple(range(gpus)),
                                  gpu_milli=min(1000, round(task.resources.gpus * 1000)))
        made.append(TaskEntry(task=task, queued_at=float(i), placement=placement,
                              started_at=float(i) if placement else None,
                              idle=placement is not None and rng.random() < 0.1))
    return made


def best_of(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--placed", type=float, default=0.2, help="share already placed")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    views = nodes(args.nodes, args.gpus)
    table = entries(args.tasks, args.nodes, args.placed, seed=1)
    now = float(args.tasks)

    def build() -> object:
        return cluster_state(views, {}, table), queue_of(table, now)

    state, queue = cluster_state(views, {}, table), queue_of(table, now)
    shell_s = best_of(build, args.repeats)
    decide_s = best_of(lambda: policy.decide(state, queue, now), args.repeats)
    print(f"{args.tasks} task entries ({len(state.running)} placed), {args.nodes} nodes x "
          f"{args.gpus} simulated GPUs")
    print(f"build ClusterState + queue: {shell_s * 1000:8.1f} ms")
    print(f"policy.decide:              {decide_s * 1000:8.1f} ms")
    print(f"shell / decide:             {shell_s / decide_s:8.2f}")


if __name__ == "__main__":
    main()
