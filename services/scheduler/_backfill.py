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
the lender finished, a paused backfill resumes and from then on holds its own share.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def find_lender(packer: Packer, req: Request,
                idle: dict[str, tuple[Running, int]]) -> Running | None:
    """The idle share `req` fits in most tightly (then by task id), or None."""
    if req.gpus != 1:
        return None
    options: list[tuple[int, str, Running]] = []
    for task_id, (lender, free) in idle.items():
        node = packer.index.get(lender.node_id, -1)
        if node < 0 or not packer.node_ok[node] or free < req.milli:
            continue
        if packer.cpu[node] < req.cpu_milli or packer.mem[node] < req.memory_mb:
            continue
        col = packer.col_of(node, lender.gpu_ids[0])
        if col < 0 or not packer.usable[node, col]:
            continue
        if req.models and packer.nodes[node].gpus[col].model not in req.models:
            continue
        if packer.gmem_free[node, col] + 1e-6 < packer.gpu_memory(req, node, col):
            continue
        options.append((free - req.milli, task_id, lender))
    return min(options, key=lambda o: (o[0], o[1]))[2] if options else None


def lend(idle: dict[str, tuple[Running, int]], lender: Running, milli: int) -> None:
    """`milli` of `lender`'s idle share is lent now; what is left stays offered."""
    task_id = lender.job.task_id
    free = idle[task_id][1] - milli
    if free > 0:
        idle[task_id] = (lender, free)
    else:
        del idle[task_id]
