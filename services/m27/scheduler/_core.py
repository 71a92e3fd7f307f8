"""The scheduling policy core (pure, deterministic): `(state, queue, now, settings) ->
decisions`, every decision with a reason a person can read. docs/scheduling.md describes
the rules; the pieces live in `_priority`, `_packing`, `_preemption` and `_backfill`.

One cycle:
1. maintenance: checkpointing tasks on draining nodes are preempted ("drain …");
2. backfills follow their lenders (pause / resume);
3. queued tasks in score order (immediate tier first, background after): placed where
   they fragment the cluster least; else an immediate task may preempt lower-score
   victims; else a ready-pool or background task may start in an idle share; else a
   ready-pool task may displace background backfills from one; else it waits, and the
   next `ready_pool` waiting tasks get their inputs staged, each on up to `stage_nodes`
   nodes. Running ready-pool backfills are ranked among them and move to capacity of
   their own when it is free at their turn, or preempt for it as their queued selves would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from m27.scheduler import _backfill, _preemption
from m27.scheduler._packing import Choice, Packer, Request, m27_demand, request_of
from m27.scheduler._priority import Score, attempt_gpu_s, order, running_score
from m27.scheduler._reasons import stage_nodes, wait_reason
from m27.scheduler.model import (
    MILLI_PER_GPU,
    ClusterState,
    Decision,
    Place,
    PolicySettings,
    Preempt,
    Queued,
    Running,
    Stage,
    Wait,
)

Action = Literal["place", "backfill", "preempt", "wait"]
DEFAULT_SETTINGS = PolicySettings()


class Explanation(msgspec.Struct, frozen=True, kw_only=True):
    """One queued task as `m27 queue --explain` shows it."""

    task_id: str
    rank: int  # 1 = considered first
    tier: str
    score: Score
    action: Action
    reason: str
    staged_on: tuple[str, ...] = ()  # nodes staged on, or with a Stage decision this cycle


class _Cycle:
    """Mutable bookkeeping of one decide() call (never escapes it)."""

    def __init__(self, state: ClusterState, queue: Sequence[Queued], now: float,
                 settings: PolicySettings) -> None:
        self.now, self.settings = now, settings
        self.decisions: list[Decision] = []
        self.explanations: list[Explanation] = []
        self.packer = build_packer(state, queue, settings)
        # Free capacity and idle shares only shrink within a cycle, so a request that found
        # no fit (or no lender) finds none later; a wait reason holds until the next change.
        self.failed: set[Request] = set()
        self.no_lender: set[Request] = set()
        self.wait_reasons: dict[Request, str] = {}
        self.idle = _backfill.lenders(state.running) if settings.backfill else {}
        alive = {r.job.task_id for r in state.running}
        self.stopping: list[_preemption.Freed] = [
            (r, 0 if r.lender and r.lender in alive else r.gpu_milli)
            for r in state.running if r.stopping]
        self.queued_ids = {q.job.task_id for q in queue}
        self.victims: list[_preemption.Victim] = []
        self.ready_left = settings.ready_pool
        # backfill pool: staged so far per share asked, and in all (`_consider`)
        self.pool: dict[int, int] = {}
        self.pool_left = 4 * settings.backfill_pool if settings.backfill else 0
        self.running = state.running

    def emit(self, decision: Decision) -> None:
        self.decisions.append(decision)
        if not isinstance(decision, Wait):
            self.wait_reasons.clear()  # a placement, reservation or stop changes the text

    def wait_reason(self, req: Request) -> str:
        reason = self.wait_reasons.get(req)
        if reason is None:
            reason = self.wait_reasons[req] = wait_reason(self.packer, req)
        return reason


def build_packer(state: ClusterState, queue: Sequence[Queued],
                 settings: PolicySettings) -> Packer:
    """Free capacity after everything running (stopping tasks still hold theirs)."""
    nodes = state.nodes
    rank = sorted(range(len(nodes)), key=lambda i: nodes[i].node_id)
    tie = [0] * len(nodes)
    for position, i in enumerate(rank):
        tie[i] = position
    demand = m27_demand([request_of(q.job) for q in queue]
                        + [request_of(r.job) for r in state.running])
    packer = Packer(nodes, demand, overprovision=settings.memory_overprovision,
                    max_temperature_c=settings.max_temperature_c, tie_rank=tie)
    alive = {r.job.task_id for r in state.running}
    for r in state.running:
        node = packer.index.get(r.node_id, -1)
        if node < 0:
            continue
        lent = bool(r.lender) and r.lender in alive
        own = Request(milli=r.gpu_milli, gpu_memory_mb=r.job.gpu_memory_mb)
        gpus = {}
        for gpu in r.gpu_ids:
            col = packer.col_of(node, gpu)
            if col >= 0:
                gpus[col] = (0 if lent else r.gpu_milli, packer.gpu_memory(own, node, col))
        packer.hold(node, gpus, r.job.cpu_milli, r.job.memory_mb)
    for r in sorted((r for r in state.running if moving(r, alive)),
                    key=lambda r: r.job.task_id):
        req = request_of(r.job)  # what it moves into is held until it is placed there
        choice = packer.choose(req)
        if choice is not None:
            packer.take(choice.node,
                        [packer.col_of(choice.node, g) for g in choice.gpu_ids], req)
    return packer


def _victims(state: ClusterState, now: float, settings: PolicySettings,
             spoken_for: set[str]) -> list[_preemption.Victim]:
    """Running tasks a higher task may preempt (scores as of now), each with its tenants."""
    alive = {r.job.task_id for r in state.running}
    tenants: dict[str, list[Running]] = {}
    for r in state.running:
        if r.lender and r.lender in alive and not r.stopping:  # (a stopping one leaves)
            tenants.setdefault(r.lender, []).append(r)
    pool = []
    for r in state.running:
        borrows = bool(r.lender) and r.lender in alive
        if r.job.task_id in spoken_for or protection(r, now, settings):
            continue
        if borrows and not (r.paused and r.paused_at is not None
                            and now - r.paused_at > settings.max_pause_s):
            continue  # a running backfill gives back no share; a paused one resumes soon
        mine = tuple(tenants.get(r.job.task_id, ()))
        if any(t.job.task_id in spoken_for or protection(t, now, settings) for t in mine):
            continue  # they would inherit the share it frees
        pool.append(_victim(r, mine, borrows, now, settings))
    return pool


def _victim(r: Running, tenants: tuple[Running, ...], borrows: bool, now: float,
            settings: PolicySettings) -> _preemption.Victim:
    background = r.job.tier == "background"
    score = running_score(r, now, settings)
    return _preemption.Victim(
        running=r, score=float("-inf") if background else score.total,
        base=float("-inf") if background else score.urgency + score.level,
        lost_gpu_s=sum(_preemption.lost_work(x, now) for x in (r, *tenants)),
        served_gpu_s=r.attained_gpu_s + attempt_gpu_s(r, now), tenants=tenants,
        borrows=borrows)


def protection(r: Running, now: float, settings: PolicySettings) -> str:
    """Why this running task may not be preempted now ("" when it may)."""
    if r.stopping:
        return "already stopping"
    if not (r.job.preemptible or r.job.tier == "background"):
        return "not preemptible"
    if r.staging:
        return "staging its inputs"
    since = r.computing_since if r.computing_since is not None else r.started_at
    if now - since < settings.min_runtime_s:
        return (f"computing {max(0.0, now - since):.0f} s < min runtime "
                f"{settings.min_runtime_s:.0f} s")
    limit = settings.max_fruitless_preemptions
    fruitless = r.job.fruitless_preemptions
    if limit > 0 and fruitless >= limit and r.last_checkpoint_at is None:
        return (f"preempted {fruitless} times without progress: protected until it "
                "commits a checkpoint")
    return ""


def _drain(state: ClusterState, settings: PolicySettings) -> list[Decision]:
    """Checkpointing tasks on draining nodes move; the others are left to finish, except
    on a node evacuated for its maintenance window, which every task leaves."""
    draining = {n.node_id for n in state.nodes if n.draining}
    evacuating = {n.node_id for n in state.nodes if n.evacuating}
    return [Preempt(task_id=r.job.task_id, attempt=r.job.attempt,
                    grace_s=settings.preempt_grace_s,
                    reason=(f"maintenance window on {r.node_id}: " + (
                        "checkpoint and move to another node" if r.job.checkpoints
                        else "stopped, runs again on another node"))
                    if r.node_id in evacuating
                    else f"drain {r.node_id}: checkpoint and move to another node")
            for r in sorted(state.running, key=lambda r: r.job.task_id)
            if r.node_id in draining and not r.stopping
            and (r.job.checkpoints or r.node_id in evacuating)]


def run_cycle(state: ClusterState, queue: Sequence[Queued], now: float,
              settings: PolicySettings) -> tuple[list[Decision], list[Explanation]]:
    """The decisions of one cycle and, per queued task, its explanation."""
    cycle = _Cycle(state, queue, now, settings)
    for decision in _drain(state, settings) + _backfill.manage(state.running):
        cycle.emit(decision)
    spoken_for = {d.task_id for d in cycle.decisions if isinstance(d, Preempt)}
    cycle.victims = _victims(state, now, settings, spoken_for)
    movers = _movers(state, now, settings, spoken_for)
    cycle.queued_ids |= set(movers)  # what stops for a mover is the mover's, as if queued
    rank = 0
    for queued, score in order([*queue, *movers.values()], now, settings):
        if queued.job.task_id in movers:
            _move(cycle, movers[queued.job.task_id].running, queued, score)
        else:
            rank += 1
            _consider(cycle, queued, score, rank)
    return cycle.decisions, cycle.explanations


class _Mover(Queued, frozen=True, kw_only=True):
    """A ready-pool backfill that may move to capacity of its own (ranked as if queued)."""

    running: Running


def _movers(state: ClusterState, now: float, settings: PolicySettings,
            spoken_for: set[str]) -> dict[str, _Mover]:
    """Immediate backfills that keep their place in the queue: a backfill is a head start,
    not a placement. One that checkpoints and may be stopped now (the protection rules,
    its own preemptibility aside: the stop is for its own sake) moves when capacity it fits
    frees, ranked by its score as a queued task would be."""
    alive = {r.job.task_id for r in state.running}
    out: dict[str, _Mover] = {}
    for r in state.running:
        if (r.job.tier != "immediate" or not r.job.checkpoints or not r.lender
                or r.lender not in alive or r.job.task_id in spoken_for):
            continue
        as_preemptible = msgspec.structs.replace(
            r, job=msgspec.structs.replace(r.job, preemptible=True))
        if protection(as_preemptible, now, settings):
            continue
        # ranked with the score it will have once requeued (this attempt's GPU time
        # counts as held then): at a better rank now, it would lose the capacity it moves
        # for to the tasks it outranked only until its stop
        out[r.job.task_id] = _Mover(job=r.job, queued_at=r.queued_at,
                                    attained_gpu_s=r.attained_gpu_s + attempt_gpu_s(r, now),
                                    running=r)
    return out


def _move(cycle: _Cycle, running: Running, queued: Queued, score: Score) -> None:
    """Checkpoint-and-stop a ready-pool backfill for capacity of its own, held for it
    (`build_packer` keeps holding it while it stops; it is placed there when requeued)."""
    job = running.job
    if any(isinstance(d, Preempt) and d.task_id == job.task_id for d in cycle.decisions):
        return  # stopped this cycle already (with its lender, for another task)
    req = request_of(queued.job)
    choice = _choose(cycle.packer, req, (), cycle.failed)
    if choice is None:
        if cycle.settings.preemption:
            _make_room(cycle, running, queued, req, score)
        return
    packer = cycle.packer
    packer.take(choice.node, [packer.col_of(choice.node, g) for g in choice.gpu_ids], req)
    where = f"GPU {','.join(map(str, choice.gpu_ids))} on {packer.nodes[choice.node].node_id}"
    cycle.emit(Preempt(task_id=job.task_id, attempt=job.attempt, for_task=job.task_id,
                       grace_s=cycle.settings.preempt_grace_s,
                       reason=f"score {score.total:.0f}: backfill in {running.lender}'s idle "
                       f"share moves to capacity of its own ({where}, held for it): "
                       "checkpoint and restart there"))
    cycle.victims = [v for v in cycle.victims if job.task_id not in {
        r.job.task_id for r, _ in v.frees()}]


def _make_room(cycle: _Cycle, running: Running, queued: Queued, req: Request,
               score: Score) -> None:
    """A ready-pool backfill keeps every right its queued self has, the right to preempt
    included: with no capacity of its own free, it preempts the victims a queued task of
    its score would (never its own lender), and keeps computing where it is until they are
    gone; then it moves into what they freed (`_move`), which is held for it meanwhile (their
    `stopping_for` names it). Without this a night MD run that started as a backfill crawled
    at its lender's I/O pace for hours beside background sweeps that a queued copy of it
    would have stopped at once (16-GPU issue-like, docs/scheduling.md)."""
    job = running.job
    plan = _preemption.plan(
        cycle.packer, req, _asker(cycle, queued, score),
        [v for v in cycle.victims
         if job.task_id not in {r.job.task_id for r, _ in v.frees()}],
        _stopping_for(cycle, job.task_id))
    if plan is None:
        return
    where = cycle.packer.nodes[plan.node].node_id
    _stop_victims(cycle, plan, job.task_id, score,
                  why=f" (a backfill in {running.lender}'s idle share that moves to "
                  f"capacity of its own on {where} once they are gone)")
    _reserve(cycle.packer, plan, req)
    _forget_freed(cycle, plan)


def _asker(cycle: _Cycle, queued: Queued, score: Score) -> _preemption.Asker:
    return _preemption.Asker(score=score.total, base=score.urgency + score.level,
                             served_gpu_s=queued.attained_gpu_s,
                             peer_yield_gpu_s=cycle.settings.peer_yield_gpu_h * 3600.0)


def _stopping_for(cycle: _Cycle, task_id: str) -> list[_preemption.Freed]:
    """Capacity already stopping that `task_id` may count on: stopped for it, for nobody
    (a drain), or for a task that no longer waits. What stops for another waiting task is
    that task's."""
    return [f for f in cycle.stopping
            if f[0].stopping_for in ("", task_id) or f[0].stopping_for not in cycle.queued_ids]


def _stop_victims(cycle: _Cycle, plan: _preemption.Plan, task_id: str, score: Score,
                  why: str = "") -> None:
    """A `Preempt` for each of the plan's victims and each backfill in its share."""
    for victim in plan.victims:
        vjob = victim.running.job
        cycle.emit(Preempt(
            task_id=vjob.task_id, attempt=vjob.attempt, for_task=task_id,
            grace_s=cycle.settings.preempt_grace_s,
            reason=f"make room for {task_id}{why} (score {score.total:.0f} > "
            f"{victim.score:.0f}); loses {victim.lost_gpu_s:.0f} GPU-s since its last "
            "checkpoint"))
        for tenant in victim.tenants:
            cycle.emit(Preempt(
                task_id=tenant.job.task_id, attempt=tenant.job.attempt, for_task=task_id,
                grace_s=cycle.settings.preempt_grace_s,
                reason=f"backfill in {vjob.task_id}, which is preempted for {task_id}: "
                "it would otherwise keep the share freed for it"))


def _forget_freed(cycle: _Cycle, plan: _preemption.Plan) -> set[str]:
    """What the plan stops or waits for is nobody else's victim, stopping capacity or
    lender in the rest of this cycle; returns those tasks."""
    taken = {r.job.task_id for v in plan.victims for r, _ in v.frees()} | {
        r.job.task_id for r, _ in plan.stopping}
    cycle.victims = [v for v in cycle.victims if not taken & {
        r.job.task_id for r, _ in v.frees()}]
    cycle.stopping = [f for f in cycle.stopping if f[0].job.task_id not in taken]
    for task_id in taken:  # no backfill into capacity that is being freed
        cycle.idle.pop(task_id, None)
    return taken


def moving(r: Running, alive: set[str]) -> bool:
    """A backfill stopping to move to capacity of its own (`_move`)."""
    return r.stopping and r.stopping_for == r.job.task_id and bool(r.lender) and (
        r.lender in alive)


def _consider(cycle: _Cycle, queued: Queued, score: Score, rank: int) -> None:
    job = queued.job
    req = request_of(job)
    choice = _choose(cycle.packer, req, queued.staged_on, cycle.failed)
    action: Action
    if choice is not None:
        action, reason = "place", _place(cycle, queued, req, choice, score)
    elif job.tier == "immediate" and cycle.settings.preemption and _preempt(
            cycle, queued, req, score):
        action, reason = "preempt", _last_wait_reason(cycle)
    elif _backfill_into(cycle, queued, req):
        action, reason = "backfill", _last_place_reason(cycle)
    elif displaced := _displace(cycle, queued, req):
        action, reason = displaced, _last_wait_reason(cycle)
    else:
        action, reason = "wait", cycle.wait_reason(req)
        if job.tier == "background":
            reason = f"background tier, leftovers only: {reason}"
        cycle.emit(Wait(task_id=job.task_id, reason=reason))
    staged = queued.staged_on
    if action in ("wait", "preempt") and cycle.ready_left > 0:
        cycle.ready_left -= 1
        staged = _stage(cycle, queued, req)
    elif (action == "wait" and job.tier == "background" and req.gpus == 1
          and cycle.pool_left > 0
          and cycle.pool.get(req.milli, 0) < cycle.settings.backfill_pool):
        # Per share asked: an idle share is lent to the first task that fits it, so the
        # first few of each size are the ones that will compute in it next.
        cycle.pool_left -= 1
        cycle.pool[req.milli] = cycle.pool.get(req.milli, 0) + 1
        staged = _stage(cycle, queued, req, filler=True)
    cycle.explanations.append(Explanation(task_id=job.task_id, rank=rank, tier=job.tier,
                                          score=score, action=action, reason=reason,
                                          staged_on=staged))


def _stage(cycle: _Cycle, queued: Queued, req: Request,
           filler: bool = False) -> tuple[str, ...]:
    """A ready-pool task's inputs are read ahead on the `stage_nodes` nodes it will most
    likely start on (one `Stage` each where not staged yet), so it starts warm wherever
    capacity frees first among them. A background task of the backfill pool (`filler`)
    is staged where idle shares it fits are lent most (`_backfill.lend_nodes`), so the
    idle share it is lent is computed in, not spent copying its inputs."""
    staged, count = list(queued.staged_on), cycle.settings.stage_nodes
    packer = cycle.packer
    where = stage_nodes(packer, req, count)
    if filler:
        where = [*_backfill.lend_nodes(packer, req, cycle.running), *where]
    for index in where:
        node_id = packer.nodes[index].node_id
        if len(staged) >= count:
            break
        if node_id not in staged:
            staged.append(node_id)
            cycle.emit(Stage(task_id=queued.job.task_id, node_id=node_id,
                             reason=(f"backfill pool: stage inputs on {node_id}, where "
                                     "idle shares it fits are lent" if filler else
                                     f"ready pool: stage inputs on {node_id}, where it "
                                     "may start first")))
    return tuple(staged)


def _choose(packer: Packer, req: Request, staged_on: tuple[str, ...],
            failed: set[Request]) -> Choice | None:
    """The least fragmenting fit on a node it is staged on (instant start), else the least
    fragmenting fit anywhere."""
    if req in failed:
        return None
    staged = [c for n in staged_on if (i := packer.index.get(n, -1)) >= 0
              and (c := packer.choose(req, only=i)) is not None]
    if staged:
        return min(staged, key=lambda c: c.frag_delta)
    choice = packer.choose(req)
    if choice is None:
        failed.add(req)
    return choice


def _place(cycle: _Cycle, queued: Queued, req: Request, choice: Choice,
           score: Score) -> str:
    packer, job = cycle.packer, queued.job
    node_id = packer.nodes[choice.node].node_id
    packer.take(choice.node, [packer.col_of(choice.node, g) for g in choice.gpu_ids], req)
    where = (f"GPU {','.join(map(str, choice.gpu_ids))} on {node_id}" if choice.gpu_ids
             else node_id)
    what = (f"{req.gpus} whole GPU(s)" if req.gpus > 1 or req.milli >= 1000
            else f"{req.milli / 1000:.2f} GPU" if req.gpus else f"{req.cpu_milli} mCPU")
    reason = (f"score {score.total:.0f}: {what} on {where}; expected fragmentation "
              f"{choice.frag_delta:+.0f} milli, the least of any fit")
    if node_id in queued.staged_on:
        reason += " (inputs staged here)"
    if job.tier == "background":
        reason = f"background tier, leftover capacity: {reason}"
    cycle.emit(Place(task_id=job.task_id, attempt=job.attempt, node_id=node_id,
                     gpu_ids=choice.gpu_ids, gpu_milli=req.milli, reason=reason))
    return reason


def _preempt(cycle: _Cycle, queued: Queued, req: Request, score: Score) -> bool:
    job = queued.job
    plan = _preemption.plan(cycle.packer, req, _asker(cycle, queued, score), cycle.victims,
                            _stopping_for(cycle, job.task_id))
    if plan is None:
        return False
    node_id = cycle.packer.nodes[plan.node].node_id
    _stop_victims(cycle, plan, job.task_id, score)
    _reserve(cycle.packer, plan, req)
    _forget_freed(cycle, plan)
    count = len(plan.victims) + len(plan.stopping)
    cycle.emit(Wait(task_id=job.task_id,
                    reason=f"waiting for {count} preempted task(s) to checkpoint on "
                    f"{node_id}"))
    return True


def _reserve(packer: Packer, plan: _preemption.Plan, req: Request) -> None:
    """Keep what the waiting task will need on the plan's node out of this cycle's later
    placements: whatever is free on the GPUs its victims (or the stopping tasks it waits
    for) hold, and enough fully free GPUs for the rest of a gang. Without this, a lower
    task takes the free half of a GPU whose other half is being preempted for a whole-GPU
    task, the GPU never becomes whole, and the preemption repeats every grace period."""
    node = plan.node
    freed = [r for v in plan.victims for r, _ in v.frees()] + [r for r, _ in plan.stopping]
    cols = sorted({packer.col_of(node, g) for r in freed for g in r.gpu_ids} - {-1})
    if req.gpus > 1 or req.milli >= MILLI_PER_GPU:
        spare = [c for c in range(packer.free.shape[1]) if c not in cols
                 and packer.usable[node, c] and packer.free[node, c] >= MILLI_PER_GPU]
        cols += spare[:max(0, max(req.gpus, 1) - len(cols))]
    held = {c: (int(max(0, packer.free[node, c])), 0.0) for c in cols}
    if any(milli for milli, _ in held.values()):
        packer.hold(node, held, 0, 0)


def _backfill_into(cycle: _Cycle, queued: Queued, req: Request) -> bool:
    job = queued.job
    if not cycle.idle or not (job.tier == "background" or cycle.ready_left > 0):
        return False
    if req in cycle.no_lender:
        return False
    lender = _backfill.find_lender(cycle.packer, req, cycle.idle, prefer=queued.staged_on)
    if lender is None:
        cycle.no_lender.add(req)
        return False
    _backfill.lend(cycle.idle, lender, req.milli)
    # A lender with a tenant placed now is no victim this cycle: the tenant is not among
    # its known tenants, so it would be left to inherit the share.
    cycle.victims = [v for v in cycle.victims if v.running.job.task_id != lender.job.task_id]
    packer = cycle.packer
    node = packer.index[lender.node_id]
    col = packer.col_of(node, lender.gpu_ids[0])
    packer.hold(node, {col: (0, packer.gpu_memory(req, node, col))}, req.cpu_milli,
                req.memory_mb)
    if job.tier == "immediate":
        cycle.ready_left -= 1
    cycle.emit(Place(task_id=job.task_id, attempt=job.attempt, node_id=lender.node_id,
                     gpu_ids=(lender.gpu_ids[0],), gpu_milli=req.milli,
                     lender=lender.job.task_id,
                     reason=f"backfill: {lender.job.task_id}'s {lender.gpu_milli / 1000:.2f}"
                     f" GPU on GPU {lender.gpu_ids[0]} of {lender.node_id} is idle (I/O "
                     "wait)"))
    return True


def _displace(cycle: _Cycle, queued: Queued, req: Request) -> Literal["preempt", "wait", ""]:
    """A ready-pool task that found no free idle share stops background backfills in one
    (`_backfill.displace`), or waits for those already leaving, and takes the share once
    they are gone: it ranks above them there as everywhere."""
    job, settings = queued.job, cycle.settings
    if not (job.tier == "immediate" and settings.preemption and settings.backfill
            and cycle.ready_left > 0):
        return ""
    spoken_for = {d.task_id for d in cycle.decisions if isinstance(d, Preempt)}
    now = cycle.now

    def may_stop(t: Running) -> bool:
        return (t.job.tier == "background" and t.job.task_id not in spoken_for
                and not protection(t, now, settings))

    def leaving(t: Running) -> bool:
        return t.stopping_for in ("", job.task_id) or t.stopping_for not in cycle.queued_ids

    found = _backfill.displace(cycle.packer, req, cycle.running, may_stop, leaving,
                               lambda t: _preemption.lost_work(t, now))
    if found is None:
        return ""
    lender = found.lender.job.task_id
    for t in found.stop:
        cycle.emit(Preempt(
            task_id=t.job.task_id, attempt=t.job.attempt, for_task=job.task_id,
            grace_s=settings.preempt_grace_s,
            reason=f"background backfill in {lender}'s idle share yields it to {job.task_id} "
            f"(immediate tier, ready pool); loses {_preemption.lost_work(t, now):.0f} GPU-s "
            "since its last checkpoint"))
    stopped = {t.job.task_id for t in found.stop} | {lender}
    cycle.victims = [v for v in cycle.victims if not stopped & {
        r.job.task_id for r, _ in v.frees()}]
    cycle.idle.pop(lender, None)  # what is left of it is not lent this cycle
    cycle.emit(Wait(task_id=job.task_id,
                    reason=f"waiting for {lender}'s idle share: "
                    + (f"{len(found.stop)} background backfill(s) in it preempted"
                       if found.stop else "its background backfills are leaving")))
    return "preempt" if found.stop else "wait"


def _last_wait_reason(cycle: _Cycle) -> str:
    last = cycle.decisions[-1]
    return last.reason if isinstance(last, Wait) else ""


def _last_place_reason(cycle: _Cycle) -> str:
    last = cycle.decisions[-1]
    return last.reason if isinstance(last, Place) else ""


def decide(state: ClusterState, queue: Sequence[Queued], now: float,
           settings: PolicySettings = DEFAULT_SETTINGS) -> list[Decision]:
    """What to start, stop, pause, resume and stage now, each with its reason."""
    return run_cycle(state, queue, now, settings)[0]


def explain(state: ClusterState, queue: Sequence[Queued], now: float,
            settings: PolicySettings = DEFAULT_SETTINGS) -> list[Explanation]:
    """Per queued task, in the order considered: its score broken down and its fate."""
    return run_cycle(state, queue, now, settings)[1]


__all__ = ["Explanation", "Running", "decide", "explain", "run_cycle"]
