"""The "by hand" baseline: how a lab runs its GPUs without a scheduler.

A person starts the next job (oldest first, on whole GPUs: nobody shares a GPU by hand) when
they notice a GPU is free. They notice only in working hours (`day_start_h`–`day_end_h`),
`notice_s` after the GPU went free (or after they arrive, if it went free overnight); the
delay varies between 0.5× and 1.5× of `notice_s`, deterministically per GPU and moment.
At night nothing new starts unless a script queued it (`by_script` jobs start at once on a
free GPU, like a `for` loop of runs). CPU-only work starts in working hours without delay.
The person remembers when each GPU went free: the policy keeps that memory, but its answer
is still a deterministic function of what it has been shown.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from typing import Final

from m27.scheduler.model import ClusterState, Decision, Place, Queued, Wait
from m27.sim._baselines import whole_gpu_place
from m27.sim._capacity import FreeMap
from m27.sim._workload import DAY_S

HOUR: Final = 3600.0


class ByHand:
    def __init__(self, scripted: Collection[str], *, clock0_s: float = 0.0,
                 notice_s: float = 1800.0, day_start_h: float = 9.0,
                 day_end_h: float = 19.0) -> None:
        self.scripted = frozenset(scripted)
        self.clock0_s, self.notice_s = clock0_s, notice_s
        self.day_start_h, self.day_end_h = day_start_h, day_end_h
        self.free_since: dict[tuple[str, int], float] = {}

    def working(self, now: float) -> bool:
        hour = ((now + self.clock0_s) % DAY_S) / HOUR
        return self.day_start_h <= hour < self.day_end_h

    def noticed_at(self, key: tuple[str, int], since: float) -> float:
        """When the person notices a GPU free since `since`."""
        clock = since + self.clock0_s
        hour = (clock % DAY_S) / HOUR
        start = since
        if hour < self.day_start_h:
            start = since + (self.day_start_h - hour) * HOUR
        elif hour >= self.day_end_h:
            start = since + (24.0 - hour + self.day_start_h) * HOUR
        jitter = random.Random(f"{key[0]}/{key[1]}/{since:.0f}").uniform(  # noqa: S311
            0.5, 1.5)  # reproducible, not secret
        return start + jitter * self.notice_s

    def __call__(self, state: ClusterState, queue: Sequence[Queued],
                 now: float) -> list[Decision]:
        held = {(r.node_id, g) for r in state.running for g in r.gpu_ids}
        for node in state.nodes:
            for gpu in node.gpus:
                key = (node.node_id, gpu.index)
                if key in held:
                    self.free_since.pop(key, None)
                else:
                    self.free_since.setdefault(key, now)
        noticed = {k for k, since in self.free_since.items()
                   if self.working(now) and self.noticed_at(k, since) <= now}
        free = FreeMap(state)
        for key in self.free_since:
            if key not in noticed and key in free.milli:
                free.milli[key] = 0  # free, but nobody has seen it yet
        scripts = FreeMap(state)
        out: list[Decision] = []
        for q in sorted(queue, key=lambda q: (q.queued_at, q.job.task_id)):
            out.append(self.one(q, free, scripts, now))
        return out

    def one(self, q: Queued, free: FreeMap, scripts: FreeMap, now: float) -> Decision:
        """A scripted job takes any free GPU; a person's job one they noticed, by day."""
        if q.job.task_id in self.scripted:
            place = whole_gpu_place(scripts, q, pack=False, reason="by hand: a script runs it")
            if place is not None:
                _mirror(free, place, q)
                return place
            return Wait(task_id=q.job.task_id, reason="by hand: the script waits for a GPU")
        if not self.working(now):
            return Wait(task_id=q.job.task_id, reason="by hand: nobody is here at night")
        place = whole_gpu_place(free, q, pack=False, reason="by hand: noticed a free GPU")
        if place is None:
            return Wait(task_id=q.job.task_id, reason="by hand: no free GPU noticed yet")
        _mirror(scripts, place, q)
        return place


def _mirror(other: FreeMap, place: Place, q: Queued) -> None:
    other.take(q.job, place.node_id, place.gpu_ids, place.gpu_milli)
