"""Idle backfill (pure): lend the GPU share of a task that waits on I/O, and take it back.

When the node-agent reports a running task's GPU idle (`Running.idle`), a ready-pool or
background task that fits inside that share (milli and GPU memory, plus the node's CPU and
host memory) starts in it: `Place(lender=...)`; several may, up to the lender's share. A
backfill holds no GPU capacity of its own while its lender runs. When the lender is busy
again the backfill is paused (SIGSTOP: it keeps its progress and memory, gives back
compute) and resumed when the lender goes idle again. A backfill paused longer than
`max_pause_s` may be preempted, but only as a victim for a waiting task that needs the GPU
memory or CPU it holds (`_core._victims`), never on a timer alone: a stop nobody takes the
place of is thrash. Nothing is lent out of a lender that is stopping or being preempted. If
the lender finished, a paused backfill resumes and from then on holds its own share. A
ready-pool task that finds no free idle share may displace background backfills from one
(`displace`): the fewest that make room, least work lost first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from m27.scheduler._packing import Packer, Request
from m27.scheduler.model import Decision, Pause, Resume, Running


def lenders(running: Sequence[Running]) -> dict[str, tuple[Running, int]]:
    """Running tasks whose share is idle, by task id, with the milli-GPU of it not lent yet
    (several backfills may share one lender, up to its share)."""
    alive = {r.job.task_id for r in running}
    lent: dict[str, int] = {}
    for r in running:
        if r.lender:
            lent[r.lender] = lent.get(r.lender, 0) + r.gpu_milli
    out: dict[str, tuple[Running, int]] = {}
    for r in running:
        free = r.gpu_milli - lent.get(r.job.task_id, 0)
        # A backfill whose lender ended holds its own share (the service keeps the lender's
        # name, the simulator clears it): it may lend like any other task.
        borrows = bool(r.lender) and r.lender in alive
        if (r.idle and not borrows and not r.stopping and not r.paused and r.gpu_ids
                and free > 0):
            out[r.job.task_id] = (r, free)
    return out


def manage(running: Sequence[Running]) -> list[Decision]:
    """Pause or resume existing backfills as their lenders change state."""
    by_id = {r.job.task_id: r for r in running}
    decisions: list[Decision] = []
    for r in sorted((r for r in running if (r.lender or r.paused) and not r.stopping),
                    key=lambda r: r.job.task_id):
        lender = by_id.get(r.lender) if r.lender else None
        job = r.job
        if lender is None or lender.stopping:
            if r.paused:  # a paused task nobody lends to any more holds its own share
                decisions.append(Resume(task_id=job.task_id, attempt=job.attempt,
                                        reason=f"lender {r.lender or '(gone)'} ended: the "
                                        "share is free, resume"))
        elif lender.idle and r.paused:
            decisions.append(Resume(task_id=job.task_id, attempt=job.attempt,
                                    reason=f"lender {r.lender} is idle again (I/O wait)"))
        elif not lender.idle and not r.paused:
            decisions.append(Pause(task_id=job.task_id, attempt=job.attempt,
                                   reason=f"lender {r.lender} is busy again: give its "
                                   "GPU share back"))
    return decisions


def find_lender(packer: Packer, req: Request, idle: dict[str, tuple[Running, int]],
                prefer: tuple[str, ...] = ()) -> Running | None:
    """The idle share `req` fits in most tightly (then by task id), or None; one on a node
    in `prefer` (its inputs are staged there: it computes at once) before any other."""
    if req.gpus != 1:
        return None
    options: list[tuple[bool, int, str, Running]] = []
    for task_id, (lender, free) in idle.items():
        node = packer.index.get(lender.node_id, -1)
        if node < 0 or not packer.node_ok[node] or free < req.milli:
            continue
        if packer.cpu[node] < req.cpu_milli or packer.mem[node] < req.memory_mb:
            continue
        col = packer.col_of(node, lender.gpu_ids[0])
        if col < 0 or not packer.usable[node, col]:
            continue
        if not packer.allowed(req)[node, col]:
            continue
        if packer.gmem_free[node, col] + 1e-6 < packer.gpu_memory(req, node, col):
            continue
        options.append((lender.node_id not in prefer, free - req.milli, task_id, lender))
    return min(options, key=lambda o: o[:3])[3] if options else None


def lend_nodes(packer: Packer, req: Request, running: Sequence[Running]) -> list[int]:
    """The nodes (packer indices) where a one-GPU background task `req` is likeliest to be
    lent an idle share: those whose running tasks with a share it fits in are idle or lend
    now, most such shares first (then node order). Nodes with none are left out."""
    alive = {r.job.task_id for r in running}
    lending = {r.lender for r in running if r.lender in alive}
    count: dict[int, int] = {}
    for r in running:
        if (r.lender and r.lender in alive) or r.gpu_milli < req.milli or not r.gpu_ids:
            continue
        node = packer.index.get(r.node_id, -1)
        if node < 0 or not packer.node_ok[node] or packer.cpu_cap[node] < req.cpu_milli:
            continue
        count[node] = count.get(node, 0) + (r.idle or r.job.task_id in lending)
    nodes = [n for n, c in count.items() if c > 0]
    return sorted(nodes, key=lambda n: (-count[n], int(packer.rank[n])))


def lend(idle: dict[str, tuple[Running, int]], lender: Running, milli: int) -> None:
    """`milli` of `lender`'s idle share is lent now; what is left stays offered."""
    task_id = lender.job.task_id
    free = idle[task_id][1] - milli
    if free > 0:
        idle[task_id] = (lender, free)
    else:
        del idle[task_id]


class Displacement(msgspec.Struct, frozen=True, kw_only=True):
    """A lender whose idle share a ready-pool task will fit in once `stop` (background
    backfills in it) and the tenants already leaving are gone; `stop` may be empty."""

    lender: Running
    stop: tuple[Running, ...]


def displace(packer: Packer, req: Request, running: Sequence[Running],
             may_stop: Callable[[Running], bool], leaving: Callable[[Running], bool],
             cost: Callable[[Running], float]) -> Displacement | None:
    """Where a ready-pool task that found no free idle share would fit if background
    backfills (those `may_stop` allows) gave theirs back. Immediate work ranks above the
    background tier for an idle share as for any other capacity: without this, background
    backfills paused in a lender keep its share lent for hours, and the ready-pool task
    meant for it waits behind them. Least work lost (`cost`) wins, then the fewest stops,
    then the tightest fit, then the lender's id."""
    if req.gpus != 1:
        return None
    alive = {r.job.task_id: r for r in running}
    tenants: dict[str, list[Running]] = {}
    for r in running:
        if r.lender and r.lender in alive:
            tenants.setdefault(r.lender, []).append(r)
    options: list[tuple[float, int, int, str, Displacement]] = []
    for task_id, mine in tenants.items():
        lender = alive[task_id]
        if (not lender.idle or lender.stopping or lender.paused or not lender.gpu_ids
                or (lender.lender and lender.lender in alive)):
            continue
        node = packer.index.get(lender.node_id, -1)
        col = packer.col_of(node, lender.gpu_ids[0]) if node >= 0 else -1
        if col < 0 or not packer.node_ok[node] or not packer.usable[node, col]:
            continue
        if not packer.allowed(req)[node, col]:
            continue
        stop = _fewest(packer, req, (node, col), lender.gpu_milli, mine, may_stop, leaving,
                       cost)
        if stop is None:
            continue
        kept = sum(t.gpu_milli for t in mine if t not in stop and not t.stopping)
        options.append((sum(cost(t) for t in stop), len(stop),
                        lender.gpu_milli - kept - req.milli, task_id,
                        Displacement(lender=lender, stop=tuple(stop))))
    return min(options, key=lambda o: o[:4])[4] if options else None


def _fewest(packer: Packer, req: Request, where: tuple[int, int], share: int,
            tenants: list[Running], may_stop: Callable[[Running], bool],
            leaving: Callable[[Running], bool],
            cost: Callable[[Running], float]) -> list[Running] | None:
    """The fewest tenants to stop (least work lost first) for `req` to fit once they and
    those already leaving are gone; None if even stopping every allowed one is not enough."""
    node, col = where
    need = packer.gpu_memory(req, node, col)
    free = [share - sum(t.gpu_milli for t in tenants), float(packer.gmem_free[node, col]),
            float(packer.cpu[node]), float(packer.mem[node])]

    def fits() -> bool:
        return (free[0] >= req.milli and free[1] + 1e-6 >= need and free[2] >= req.cpu_milli
                and free[3] >= req.memory_mb)

    def release(t: Running) -> bool:
        held = packer.gpu_memory(Request(milli=t.gpu_milli, gpu_memory_mb=t.job.gpu_memory_mb),
                                 node, col)
        for i, amount in enumerate((t.gpu_milli, held, t.job.cpu_milli, t.job.memory_mb)):
            free[i] += amount
        return fits()

    fit = fits()
    for t in tenants:
        if t.stopping and leaving(t):
            fit = release(t)
    if fit:
        return []
    stop: list[Running] = []
    for t in sorted((t for t in tenants if not t.stopping and may_stop(t)),
                    key=lambda t: (cost(t), t.job.task_id)):
        stop.append(t)
        if release(t):
            return stop
    return None
