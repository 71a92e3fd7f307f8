"""Placement policy (pure): `(cluster, queue, now) -> decisions`, each with its reason.

The policy core is `decide(state, queue, now, settings)` (and `explain`) over the structs
of `m27.scheduler.model`; it lives in `_core` and its helpers (docs/scheduling.md). The
older `schedule(nodes, placements, queue)` below stays until the service has moved over:
for now a simple, predictable policy: tasks in order of urgency, then waiting time; each is
placed on the first capacity that fits, so a small task may start while a big one waits.
GPU capacity counts in tenths. Fractional requests go best-fit onto the GPU whose free share
they fill most tightly (packing leaves whole GPUs free for whole-GPU work); whole-GPU
requests take fully free GPUs on one node (all or nothing); CPU work goes to the node with
the most free CPU slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from m27.common.events import EnqueueTask
from m27.common.model import TENTHS_PER_GPU, GpuInfo, Urgency
from m27.scheduler._core import Explanation, decide, explain, protection
from m27.scheduler._packing import Packer, Request, request_of, typical_demand
from m27.scheduler._priority import Score

__all__ = [
    "URGENCY_RANK", "Decision", "Explanation", "Node", "Packer", "Place", "Placement",
    "QueuedTask", "Request", "Score", "Wait", "decide", "explain", "is_alive",
    "protection", "queue_order", "request_of", "schedule", "typical_demand",
]

URGENCY_RANK: Final[dict[Urgency, int]] = {"low": 0, "normal": 1, "high": 2, "urgent": 3}


class Node(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    gpus: tuple[GpuInfo, ...]
    cpu_slots: int
    last_heartbeat: float
    up: bool = True  # takes work: False while it stops, once it stopped or was lost
    stopped: bool = False  # its agent shut down and reported every task it had


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Capacity a task holds: tenths on each of its GPUs, and CPU slots."""

    task_id: str
    attempt: int
    node_id: str
    gpu_ids: tuple[int, ...]
    gpu_tenths: int  # per GPU in gpu_ids
    cpus: int


class QueuedTask(msgspec.Struct, frozen=True, kw_only=True):
    task: EnqueueTask
    queued_at: float


class Place(msgspec.Struct, frozen=True, kw_only=True, tag="place"):
    placement: Placement
    reason: str


class Wait(msgspec.Struct, frozen=True, kw_only=True, tag="wait"):
    task_id: str
    reason: str


Decision = Place | Wait


class _Free:
    """Free capacity of every usable node, updated as decisions are made."""

    def __init__(self, nodes: Iterable[Node], placements: Iterable[Placement]) -> None:
        self.gpus: dict[str, dict[int, int]] = {}
        self.cpus: dict[str, int] = {}
        for node in nodes:
            if node.up:
                self.gpus[node.node_id] = {g.index: TENTHS_PER_GPU for g in node.gpus}
                self.cpus[node.node_id] = node.cpu_slots
        for held in placements:
            self.take(held)

    def take(self, placement: Placement) -> None:
        if placement.node_id not in self.cpus:
            return
        self.cpus[placement.node_id] -= placement.cpus
        for index in placement.gpu_ids:
            gpus = self.gpus[placement.node_id]
            gpus[index] = gpus.get(index, 0) - placement.gpu_tenths


def is_alive(node: Node, now: float, timeout: float) -> bool:
    """Up, and its last heartbeat is at most `timeout` seconds old."""
    return node.up and now - node.last_heartbeat <= timeout


def queue_order(queue: Iterable[QueuedTask]) -> list[QueuedTask]:
    """Most urgent first; among equals, the one waiting longest."""
    return sorted(queue, key=lambda q: (-URGENCY_RANK[q.task.urgency], q.queued_at,
                                        q.task.task_id))


def schedule(nodes: Sequence[Node], placements: Sequence[Placement],
             queue: Sequence[QueuedTask]) -> list[Decision]:
    """One decision per queued task: where it starts now, or why it waits."""
    free = _Free(nodes, placements)
    decisions: list[Decision] = []
    for queued in queue_order(queue):
        decision = _decide(free, queued.task)
        if isinstance(decision, Place):
            free.take(decision.placement)
        decisions.append(decision)
    return decisions


def _decide(free: _Free, task: EnqueueTask) -> Decision:
    if not free.cpus:
        return Wait(task_id=task.task_id, reason="no node is up")
    tenths = task.resources.gpu_tenths
    if tenths == 0:
        return _place_cpu(free, task)
    if tenths < TENTHS_PER_GPU:
        return _place_fraction(free, task, tenths)
    return _place_whole(free, task, tenths // TENTHS_PER_GPU)


def _placement(task: EnqueueTask, node_id: str, gpu_ids: tuple[int, ...],
               tenths: int) -> Placement:
    return Placement(task_id=task.task_id, attempt=task.attempt, node_id=node_id,
                     gpu_ids=gpu_ids, gpu_tenths=tenths, cpus=task.resources.cpus)


def _place_cpu(free: _Free, task: EnqueueTask) -> Decision:
    need = task.resources.cpus
    fits = [(n, c) for n, c in free.cpus.items() if c >= need]
    if not fits:
        most = max(free.cpus.values())
        return Wait(task_id=task.task_id,
                    reason=f"needs {need} CPU slot(s); the most free on a node is {most}")
    node_id, slots = max(fits, key=lambda item: (item[1], _neg(item[0])))
    return Place(placement=_placement(task, node_id, (), 0),
                 reason=f"{node_id} has {slots} free CPU slot(s), the most of any node")


def _neg(name: str) -> tuple[int, ...]:
    """Sort key that makes `max` prefer the alphabetically first name on ties."""
    return tuple(-ord(c) for c in name)


def _place_fraction(free: _Free, task: EnqueueTask, tenths: int) -> Decision:
    options = [
        (left - tenths, node_id, index)
        for node_id, gpus in free.gpus.items() if free.cpus[node_id] >= task.resources.cpus
        for index, left in gpus.items() if left >= tenths
    ]
    if not options:
        return Wait(task_id=task.task_id,
                    reason=f"needs {tenths / TENTHS_PER_GPU:.1f} GPU; "
                    + _largest_free_share(free))
    remainder, node_id, index = min(options)
    reason = (f"best fit: GPU {index} on {node_id} keeps "
              f"{remainder / TENTHS_PER_GPU:.1f} GPU free")
    return Place(placement=_placement(task, node_id, (index,), tenths), reason=reason)


def _place_whole(free: _Free, task: EnqueueTask, count: int) -> Decision:
    options = []
    for node_id, gpus in free.gpus.items():
        idle = sorted(i for i, left in gpus.items() if left == TENTHS_PER_GPU)
        if len(idle) >= count and free.cpus[node_id] >= task.resources.cpus:
            options.append((len(idle), node_id, tuple(idle[:count])))
    if not options:
        most = max((sum(left == TENTHS_PER_GPU for left in g.values())
                    for g in free.gpus.values()), default=0)
        return Wait(task_id=task.task_id,
                    reason=f"needs {count} whole GPU(s) on one node; the most fully free "
                    f"GPUs on a node is {most}")
    idle_count, node_id, gpu_ids = min(options)
    reason = f"{node_id} has {idle_count} free GPU(s): the tightest fit for {count}"
    return Place(placement=_placement(task, node_id, gpu_ids, TENTHS_PER_GPU), reason=reason)


def _largest_free_share(free: _Free) -> str:
    best = max(((left, node_id, index) for node_id, gpus in free.gpus.items()
                for index, left in gpus.items()), default=None)
    if best is None:
        return "no node has a GPU"
    left, node_id, index = best
    return f"the largest free share is {left / TENTHS_PER_GPU:.1f} (GPU {index} on {node_id})"
