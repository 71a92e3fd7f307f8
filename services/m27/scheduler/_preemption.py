"""Preemption (pure): which running tasks to checkpoint-and-stop so a higher task fits.

A victim must be preemptible (or in the background tier), of a strictly lower class than the
task it makes room for (urgency weight + user level weight: aging and the held term order
the queue but give no right to stop a peer, or equal tasks would take turns preempting each
other) — unless it is a peer that has held `peer_yield_gpu_h` GPU-hours and the task has
held less (least-attained-service, one way only, so peers never take turns) — and strictly
lower in score (background victims are both: they only take leftovers), and not protected
(`_core.protection`: staging, computing less than `min_runtime_s` whatever its tier, or
preempted `max_fruitless_preemptions` times in a row without progress). A running backfill
is no victim (it holds no share of its own). Tasks already `stopping` count as still
holding their capacity, but as free victims: a task that fits once they are gone waits for
them instead of preempting more — unless they stop for another waiting task.

Among the nodes where the task would fit, the victim set loses the least work: GPU-seconds
since the victim's last checkpoint (since its start if it never checkpointed, or if it does
not checkpoint at all), then the lowest scores, then the fewest victims.

A victim's tenants (backfills started into its idle share) are stopped with it: otherwise
they would inherit the share it frees and the task it was stopped for would never fit (the
livelock of docs/scheduling.md, "Thrash"). A victim with a tenant that may not be stopped
is no victim. A backfill holds GPU memory and CPU but no share of its own, so stopping one
frees only those.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from m27.scheduler._packing import Packer, Request
from m27.scheduler.model import Running

#: A running task whose capacity a stop gives back, with the milli-GPU it holds per GPU.
Freed = tuple[Running, int]


class Victim(msgspec.Struct, frozen=True, kw_only=True):
    running: Running
    score: float
    lost_gpu_s: float  # work lost if stopped now (its tenants' included)
    base: float = float("-inf")  # its class: urgency weight + user level weight
    served_gpu_s: float = float("inf")  # GPU-seconds held, all attempts: peer yield
    #: Backfills running in its idle share: stopped with it.
    tenants: tuple[Running, ...] = ()
    borrows: bool = False  # it is a backfill itself: holds no share of its own

    def frees(self) -> list[Freed]:
        own = (self.running, 0 if self.borrows else self.running.gpu_milli)
        return [own, *((t, 0) for t in self.tenants)]


class Asker(msgspec.Struct, frozen=True, kw_only=True):
    """The task preemption would make room for."""

    score: float
    base: float = float("inf")  # its class
    served_gpu_s: float = 0.0
    peer_yield_gpu_s: float = 0.0  # 0: peers never yield

    def may_stop(self, victim: Victim) -> bool:
        """Strictly lower in score, and of a lower class or a peer that has held its
        share (least-attained-service among peers, never the other way round)."""
        if not victim.score < self.score:
            return False
        if victim.base < self.base:
            return True
        return (self.peer_yield_gpu_s > 0 and victim.base <= self.base
                and self.served_gpu_s < self.peer_yield_gpu_s <= victim.served_gpu_s)


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    node: int
    victims: tuple[Victim, ...]  # new ones to preempt (each with its tenants)
    stopping: tuple[Freed, ...]  # already stopping, counted on


def lost_work(running: Running, now: float) -> float:
    """GPU-seconds a stop now throws away."""
    since = running.started_at
    if running.job.checkpoints and running.last_checkpoint_at is not None:
        since = max(since, running.last_checkpoint_at)
    share = running.gpu_milli * max(1, len(running.gpu_ids)) / 1000.0
    return max(0.0, now - since) * max(share, 0.001)


def _fits(packer: Packer, node: int, req: Request, freed: Sequence[Freed]) -> bool:
    """Would `req` fit on `node` once `freed` have released their capacity?"""
    if not packer.node_ok[node]:
        return False
    cpu = packer.cpu[node] + sum(r.job.cpu_milli for r, _ in freed)
    mem = packer.mem[node] + sum(r.job.memory_mb for r, _ in freed)
    if cpu < req.cpu_milli or mem < req.memory_mb:
        return False
    if req.gpus == 0:
        return True
    free = packer.free[node].astype(np.float64)
    gmem = packer.gmem_free[node].copy()
    for r, milli in freed:
        for gpu in r.gpu_ids:
            col = packer.col_of(node, gpu)
            if col >= 0:
                free[col] += milli
                gmem[col] += packer.gpu_memory(
                    Request(milli=r.gpu_milli, gpu_memory_mb=r.job.gpu_memory_mb), node, col)
    mask = packer.usable[node] & (free >= req.milli) & packer.allowed(req)[node]
    need = np.array([packer.gpu_memory(req, node, c) for c in range(free.size)])
    mask &= gmem >= need - 1e-6
    return int(mask.sum()) >= req.gpus


def plan(packer: Packer, req: Request, asker: Asker, victims: Sequence[Victim],
         stopping: Sequence[Freed]) -> Plan | None:
    """The cheapest way to make room for `req`, or None when no victim set is enough."""
    best: tuple[tuple[float, float, int, int], Plan] | None = None
    touched = {v.running.node_id for v in victims} | {s.node_id for s, _ in stopping}
    for node_id in sorted(touched):
        node = packer.index.get(node_id, -1)
        if node < 0:
            continue
        held = [s for s in stopping if s[0].node_id == node_id]
        mine = sorted((v for v in victims if v.running.node_id == node_id
                       and asker.may_stop(v)),
                      key=lambda v: (v.lost_gpu_s, v.score, v.running.job.task_id))
        chosen = _greedy(packer, node, req, mine, held)
        if chosen is None:
            continue
        key = (sum(v.lost_gpu_s for v in chosen), sum(v.score for v in chosen),
               len(chosen), int(packer.rank[node]))
        if best is None or key < best[0]:
            best = (key, Plan(node=node, victims=tuple(chosen), stopping=tuple(held)))
    return best[1] if best else None


def _greedy(packer: Packer, node: int, req: Request, ordered: Sequence[Victim],
            held: Sequence[Freed]) -> list[Victim] | None:
    """Cheapest victims first until `req` fits; then drop any that turned out unneeded."""
    if not ordered and not held:
        return None
    chosen: list[Victim] = []
    freed = list(held)
    if not _fits(packer, node, req, freed):
        for victim in ordered:
            if any(_overlap(victim, other) for other in chosen):
                continue  # a tenant already stopped with its lender
            chosen.append(victim)
            if _fits(packer, node, req, freed + _frees(chosen)):
                break
        else:
            return None
    for victim in sorted(chosen, key=lambda v: (-v.lost_gpu_s, -v.score)):
        rest = [v for v in chosen if v is not victim]
        if _fits(packer, node, req, freed + _frees(rest)):
            chosen = rest
    return chosen


def _overlap(a: Victim, b: Victim) -> bool:
    return bool({r.job.task_id for r, _ in a.frees()} & {r.job.task_id for r, _ in b.frees()})


def _frees(victims: Sequence[Victim]) -> list[Freed]:
    return [f for v in victims for f in v.frees()]
