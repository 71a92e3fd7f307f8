"""Small builders for policy tests: clusters, jobs and running tasks in a line each."""

from __future__ import annotations

from typing import Any

from m27.scheduler.model import (
    ClusterState,
    Decision,
    Gpu,
    Job,
    Node,
    Place,
    Preempt,
    Queued,
    Running,
    Wait,
)


def node(name: str, gpus: int = 2, *, cpu: int = 16_000, mem: int = 65_536,
         gpu_mem: int = 16_384, model: str = "", temps: tuple[float | None, ...] = (),
         throttled: tuple[int, ...] = (), **kw: Any) -> Node:
    return Node(node_id=name, cpu_milli=cpu, memory_mb=mem, gpus=tuple(
        Gpu(index=i, memory_mb=gpu_mem, model=model, simulated=True,
            temperature_c=temps[i] if i < len(temps) else None,
            throttled=("thermal",) if i in throttled else ()) for i in range(gpus)), **kw)


def job(name: str, milli: int = 0, **kw: Any) -> Job:
    kw.setdefault("cpu_milli", 1000)
    return Job(task_id=name, gpu_milli=milli, **kw)


def queued(name: str, milli: int = 0, at: float = 0.0, *, staged_on: tuple[str, ...] = (),
           attained: float = 0.0, **kw: Any) -> Queued:
    return Queued(job=job(name, milli, **kw), queued_at=at, staged_on=staged_on,
                  attained_gpu_s=attained)


def running(name: str, node_id: str, gpus: tuple[int, ...], milli: int, *,
            started: float = 0.0, queued_at: float = 0.0, idle: bool = False,
            paused: bool = False, lender: str = "", stopping: bool = False,
            last_checkpoint_at: float | None = None, paused_at: float | None = None,
            stopping_for: str = "", staging: bool = False,
            computing_since: float | None = None, **kw: Any) -> Running:
    total = milli * len(gpus) if milli >= 1000 else milli
    return Running(job=job(name, total, **kw), node_id=node_id, gpu_ids=gpus,
                   gpu_milli=milli, started_at=started, queued_at=queued_at, idle=idle,
                   paused=paused, lender=lender, stopping=stopping,
                   last_checkpoint_at=last_checkpoint_at, paused_at=paused_at,
                   stopping_for=stopping_for, staging=staging,
                   computing_since=computing_since)


def state(*nodes: Node, running: tuple[Running, ...] = ()) -> ClusterState:
    return ClusterState(nodes=nodes, running=running)


def places(decisions: list[Decision]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {d.task_id: (d.node_id, d.gpu_ids) for d in decisions if isinstance(d, Place)}


def waits(decisions: list[Decision]) -> dict[str, str]:
    return {d.task_id: d.reason for d in decisions if isinstance(d, Wait)}


def preempted(decisions: list[Decision]) -> list[str]:
    return [d.task_id for d in decisions if isinstance(d, Preempt)]
