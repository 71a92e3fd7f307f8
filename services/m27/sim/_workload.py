"""What the simulator replays: a cluster and the jobs submitted to it (pure data).

A `SimJob` is a policy `Job` plus what only the simulator knows: when it is submitted, how
much compute it needs at solo speed, and how its GPU goes idle (periodic I/O phases).
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from m27.scheduler.model import MILLI_PER_GPU, Gpu, Job, Node

DAY_S: Final = 86_400.0


class SimJob(msgspec.Struct, frozen=True, kw_only=True):
    job: Job
    submit_s: float
    #: Compute it needs, in seconds at solo speed (its own share, nobody else busy on it).
    duration_s: float
    #: Every `io_every_s` seconds of compute it stops for `io_s` wall seconds of I/O
    #: (trajectory writes, data-loading stalls): its GPU share is held but idle. 0: never.
    io_every_s: float = 0.0
    io_s: float = 0.0
    #: A checkpoint every this many seconds of running; a stop loses the work since the
    #: last one (everything, when 0).
    checkpoint_s: float = 0.0
    #: Copying its inputs before compute starts (idle GPU); skipped on a staged node.
    stage_s: float = 0.0
    #: Queued by a script (starts unattended at night even by hand), not by a person.
    by_script: bool = False
    kind: str = ""  # md, train, analysis, cpu, background, trace: for reports only


class Trace(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    nodes: tuple[Node, ...]
    jobs: tuple[SimJob, ...]
    #: Seconds after midnight at virtual time 0: what "night" and "09:00" mean.
    clock0_s: float = 0.0
    #: Rows the reader skipped (no duration, larger than any node, ...), with why.
    skipped: tuple[str, ...] = ()


def make_nodes(count: int, gpus_per_node: int, *, gpu_memory_mb: int = 16_384,
               cpu_milli: int = 32_000, model: str = "") -> tuple[Node, ...]:
    """A homogeneous cluster of simulated GPUs."""
    return tuple(
        Node(node_id=f"n{i:03d}", cpu_milli=cpu_milli,
             gpus=tuple(Gpu(index=g, memory_mb=gpu_memory_mb, model=model, simulated=True)
                        for g in range(gpus_per_node)))
        for i in range(count))


def expected_wall_s(sim: SimJob) -> float:
    """Solo-speed wall time: compute plus its I/O phases plus staging."""
    phases = math.ceil(sim.duration_s / sim.io_every_s) - 1 if sim.io_every_s > 0 else 0
    return sim.duration_s + max(0, phases) * sim.io_s + sim.stage_s


def gpus_of(sim: SimJob) -> float:
    """The GPUs it holds: its share of one, or its whole GPUs."""
    milli = sim.job.gpu_milli
    return milli / MILLI_PER_GPU if milli < MILLI_PER_GPU else float(milli // MILLI_PER_GPU)


def gpu_count(nodes: tuple[Node, ...]) -> int:
    return sum(len(n.gpus) for n in nodes)


def demand_bound(trace: Trace, horizon_s: float) -> float:
    """The work submitted before `horizon_s`, at solo speed, / the cluster's GPU time over
    it (at most 1): no policy's busy GPU time or goodput can exceed it."""
    if horizon_s <= 0 or not trace.nodes:
        return 0.0
    work = 0.0
    for sim in trace.jobs:
        if sim.submit_s < horizon_s and sim.job.gpu_milli > 0:
            work += sim.duration_s * gpus_of(sim)
    return min(1.0, work / (gpu_count(trace.nodes) * horizon_s))


def is_night(submit_s: float, clock0_s: float) -> bool:
    """Submitted between 18:00 and 08:00."""
    hour = ((submit_s + clock0_s) % DAY_S) / 3600.0
    return hour >= 18.0 or hour < 8.0


def next_morning(submit_s: float, clock0_s: float) -> float:
    """The first 09:00 after a night submission (virtual seconds)."""
    clock = submit_s + clock0_s
    midnight = clock - clock % DAY_S
    nine = midnight + 9 * 3600.0
    if clock >= nine:
        nine += DAY_S
    return nine - clock0_s
