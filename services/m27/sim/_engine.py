"""The simulator's engine: drives a `Policy` in virtual time from an event heap (no NATS).

Events: arrivals, per-task wake-ups (completion, I/O phase start and end, idle detected),
grace expiries of preempted tasks, task failures, and policy ticks. After every batch of
events at one instant the policy is asked for decisions, which the engine validates and
applies (an invalid one is counted and ignored, never trusted).

Interference model: a task's solo speed is its speed on its own share with nobody else busy
on its GPU. On each GPU the busy tasks' shares are summed (a task in an I/O phase, staging
its inputs or paused uses none); when the sum S exceeds 1000 milli (backfill into a lender
that is busy again), every busy task there runs at 1000/S of its solo speed, a gang at its
slowest GPU's rate. So the compute done on one GPU never exceeds one GPU's worth.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from m27.scheduler.model import (
    MILLI_PER_GPU,
    ClusterState,
    Decision,
    Job,
    Node,
    Pause,
    Place,
    Policy,
    Preempt,
    Queued,
    Resume,
    Running,
    Stage,
)
from m27.sim._capacity import FreeMap, demand_milli, gpus_needed
from m27.sim._errors import SimError
from m27.sim._metrics import JobOutcome, RawRun, Sample
from m27.sim._workload import DAY_S, SimJob, Trace, gpu_count, is_night, next_morning

EPS: Final = 1e-6
Kind = Literal["arrive", "wake", "stop", "fail", "tick", "maint", "maint_end"]
NodePhase = Literal["up", "evacuating", "command"]


class MaintenanceSim(msgspec.Struct, frozen=True, kw_only=True):
    """A nightly reset of every node at `at_s` after each midnight of the trace, taking
    `command_s` per node: `cron` kills what runs then (a crontab line), `window` is
    m27's maintenance window (keeps work that would be cut short off the nodes for
    `lead_s` before, empties each node — checkpointing work checkpoints and moves, the
    rest is stopped — then runs the command; m27.common.windows)."""

    mode: Literal["cron", "window"]
    at_s: float = 3 * 3600.0
    command_s: float = 120.0
    lead_s: float = 7200.0


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    horizon_s: float | None = None  # stop here; None: once every job is done
    tick_s: float = 60.0  # the policy is also asked this often (aging, notice delays)
    # The agent reports idle after `[node] idle_samples` (3) samples `sample_interval` (1 s)
    # apart.
    idle_detect_s: float = 3.0
    failure_mtbf_h: float = 0.0  # mean running hours between a task's crashes; 0: none
    seed: int = 0
    bucket_s: float = 900.0  # resolution of the utilization-over-time series
    memory_overprovision: float = 1.0
    give_up_s: float = 7 * DAY_S  # nothing running or placed for this long: stop
    maintenance: MaintenanceSim | None = None


@dataclass(slots=True)
class _Task:
    sim: SimJob
    remaining: float
    queued_at: float
    attempt: int = 1
    attained: float = 0.0  # GPU-s held by earlier attempts
    first_start: float | None = None
    end: float | None = None
    node_id: str = ""
    gpu_ids: tuple[int, ...] = ()
    milli: int = 0
    started_at: float = 0.0
    phase: Literal["busy", "io"] = "busy"
    staging: bool = False  # the io phase is the copy of its inputs before it computes
    computing_since: float | None = None
    fruitless: int = 0  # consecutive preempted attempts without a checkpoint
    stopping_for: str = ""
    preempted: int = 0  # times preempted (all attempts)
    phase_left: float = 0.0  # busy: compute s to the next I/O phase; io: wall s left
    io_since: float = 0.0
    idle_seen: bool = False  # the policy has been (or is about to be) told it is idle
    paused: bool = False
    paused_at: float | None = None
    stopping: bool = False
    lender: str = ""
    ckpt_at: float | None = None
    ckpt_remaining: float = 0.0
    attempt_remaining: float = 0.0  # `remaining` when this attempt started
    next_ckpt: float = math.inf
    rate: float = 1.0
    wake_at: float = math.inf
    token: int = 0
    view: Running | None = None  # what the policy sees while it runs, built when asked
    qview: Queued | None = None  # ... and while it waits

    @property
    def demand(self) -> int:
        return demand_milli(self.sim.job)

    @property
    def busy(self) -> bool:
        return self.phase == "busy" and not self.paused

    def held_gpu_s(self, now: float) -> float:
        return self.milli * len(self.gpu_ids) / MILLI_PER_GPU * (now - self.started_at)


@dataclass
class _Counters:
    busy: float = 0.0
    alloc: float = 0.0
    work: float = 0.0
    lost: float = 0.0
    held_staging: float = 0.0
    held_io: float = 0.0
    held_unseen: float = 0.0
    preemptions: int = 0
    failures: int = 0
    maintenance_kills: int = 0  # tasks a cron reset killed
    calls: int = 0
    max_gpu_compute: float = 0.0
    rejected: Counter[str] = field(default_factory=Counter)


#: Told (jobs finished, jobs in the run) as the simulation goes (`m27 simulate`'s bar).
OnProgress = Callable[[int, int], None]


class _Sim:
    def __init__(self, trace: Trace, policy: Policy, cfg: SimConfig,
                 on_progress: OnProgress | None = None) -> None:
        self.trace, self.policy, self.cfg = trace, policy, cfg
        self.on_progress = on_progress
        self.jobs_done = 0
        self.jobs_total = 0
        self.rng = random.Random(cfg.seed)  # noqa: S311 - reproducible, not secret
        self.now = 0.0
        self.heap: list[tuple[float, int, Kind, str, int]] = []
        self.seq = 0
        self.tasks: dict[str, _Task] = {}
        self.queue: dict[str, _Task] = {}
        self.running: dict[str, _Task] = {}
        self.staged: dict[str, dict[str, float]] = {}  # task → node → its inputs ready at
        self.c = _Counters()
        self.rates = (0.0, 0.0, 0.0)  # busy GPUs, allocated GPUs, work GPUs: now
        #: GPUs held by their own tasks while staging, while in I/O, and of those while the
        #: idle is not yet detected (nothing can be lent into that)
        self.held = (0.0, 0.0, 0.0)
        self.buckets: dict[int, list[float]] = {}
        self.last_progress = 0.0
        self.arrivals_left = 0
        self.dirty = True  # something the policy can see changed since its last call
        self.by_id: dict[str, SimJob] = {j.job.task_id: j for j in trace.jobs}
        self.phase: dict[str, NodePhase] = {n.node_id: "up" for n in trace.nodes}
        self.next_maintenance = math.inf
        if len(self.by_id) != len(trace.jobs):
            raise SimError(f"trace {trace.name}: task ids are not unique")
        if not trace.nodes:
            raise SimError(f"trace {trace.name}: the cluster has no nodes")

    def push(self, at: float, kind: Kind, task_id: str = "", token: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, task_id, token))

    def run(self) -> RawRun:
        horizon = self.cfg.horizon_s if self.cfg.horizon_s is not None else math.inf
        for sim in self.trace.jobs:
            if sim.submit_s <= horizon:
                self.push(sim.submit_s, "arrive", sim.job.task_id)
                self.arrivals_left += 1
        self.jobs_total = self.arrivals_left
        self.push(0.0, "tick")
        if self.cfg.maintenance is not None:  # at_s is a time of day on the trace's clock
            self.next_maintenance = (self.cfg.maintenance.at_s - self.trace.clock0_s) % DAY_S
            self.push(self.next_maintenance, "maint")
        while self.heap:
            at = self.heap[0][0]
            if at > horizon:
                self.advance(horizon)
                break
            self.advance(at)
            while self.heap and self.heap[0][0] <= at + EPS:
                _, _, kind, task_id, token = heapq.heappop(self.heap)
                self.handle(kind, task_id, token)
            self.step_states()
            if self.finished():
                break
            self.decide()
            self.reschedule()
        if self.on_progress is not None:
            self.on_progress(self.jobs_done, self.jobs_total)
        return self.raw(horizon)

    def finished(self) -> bool:
        if not self.arrivals_left and not self.queue and not self.running:
            return True
        stuck = not self.running and self.now - self.last_progress > self.cfg.give_up_s
        return stuck and not self.arrivals_left

    # --- time passing -------------------------------------------------------------------

    def advance(self, to: float) -> None:
        dt = to - self.now
        if dt <= 0:
            return
        busy, alloc, work = self.rates
        self.c.busy += busy * dt
        self.c.alloc += alloc * dt
        self.c.work += work * dt
        self.c.held_staging += self.held[0] * dt
        self.c.held_io += self.held[1] * dt
        self.c.held_unseen += self.held[2] * dt
        self.add_to_buckets(self.now, to, busy, alloc, work)
        for task in self.running.values():
            self.progress(task, dt, to)
        self.now = to

    def add_to_buckets(self, start: float, end: float, *values: float) -> None:
        size = self.cfg.bucket_s
        t = start
        while t < end - EPS:
            index = int(t // size)
            stop = min(end, (index + 1) * size)
            bucket = self.buckets.setdefault(index, [0.0, 0.0, 0.0])
            for i, value in enumerate(values):
                bucket[i] += value * (stop - t)
            t = stop

    def progress(self, task: _Task, dt: float, to: float) -> None:
        before = task.remaining
        done = task.rate * dt if task.busy else 0.0
        if task.phase == "busy":
            task.remaining -= done
            task.phase_left -= done
        else:
            task.phase_left -= dt
        while task.next_ckpt <= to + EPS:
            into = task.next_ckpt - (to - dt)
            task.ckpt_remaining = before - (task.rate * into if task.busy else 0.0)
            if task.ckpt_remaining < task.attempt_remaining - EPS:  # it kept some work
                task.ckpt_at, task.view = task.next_ckpt, None
            task.next_ckpt += task.sim.checkpoint_s

    def step_states(self) -> None:
        """Completions and I/O phase changes due now. Only changes a policy can see (an
        idle report, a lender busy again, a task gone) make the next call necessary."""
        for task in list(self.running.values()):
            if task.remaining <= EPS:
                self.finish(task)
            elif task.phase == "busy" and task.phase_left <= EPS and task.sim.io_s > 0:
                task.phase, task.phase_left, task.io_since = "io", task.sim.io_s, self.now
                task.idle_seen, task.view = self.idle(task), None
                self.dirty |= task.idle_seen
            elif task.phase == "io" and task.phase_left <= EPS:
                task.phase_left = task.sim.io_every_s if task.sim.io_every_s > 0 else math.inf
                task.phase = "busy"
                if task.staging:
                    task.staging, task.computing_since = False, self.now
                self.dirty |= task.idle_seen  # its idle report ends now
                task.idle_seen, task.view = False, None
            elif task.phase == "io" and self.idle(task) and not task.idle_seen:
                task.idle_seen, task.view = True, None
                self.dirty = True

    def idle(self, task: _Task) -> bool:
        return task.phase == "io" and self.now - task.io_since >= self.cfg.idle_detect_s - EPS

    def reschedule(self) -> None:
        """Rates from the interference model, and each running task's next wake-up."""
        busy_on: dict[tuple[str, int], int] = {}
        alloc_on: dict[tuple[str, int], int] = {}
        for task in self.running.values():
            for index in task.gpu_ids:
                key = (task.node_id, index)
                alloc_on[key] = alloc_on.get(key, 0) + (0 if task.lender else task.milli)
                if task.busy:
                    busy_on[key] = busy_on.get(key, 0) + task.demand
        work = staging = io = unseen = 0.0
        compute_on: dict[tuple[str, int], float] = {}
        for task in self.running.values():
            if task.phase == "io" and not task.lender and task.gpu_ids:
                held = task.milli * len(task.gpu_ids) / MILLI_PER_GPU
                if task.staging:
                    staging += held
                else:
                    io += held
                if not self.idle(task):
                    unseen += held
            task.rate = min((min(1.0, MILLI_PER_GPU / busy_on[(task.node_id, i)])
                             for i in task.gpu_ids if busy_on.get((task.node_id, i))),
                            default=1.0)
            if task.busy and task.gpu_ids:
                work += task.rate * task.demand * len(task.gpu_ids) / MILLI_PER_GPU
                for index in task.gpu_ids:
                    key = (task.node_id, index)
                    compute_on[key] = compute_on.get(key, 0.0) + task.rate * task.demand
            self.wake(task)
        self.c.max_gpu_compute = max([self.c.max_gpu_compute, *compute_on.values()])
        busy = sum(min(MILLI_PER_GPU, v) for v in busy_on.values()) / MILLI_PER_GPU
        alloc = sum(min(MILLI_PER_GPU, v) for v in alloc_on.values()) / MILLI_PER_GPU
        self.rates = (busy, alloc, work)
        self.held = (staging, io, unseen)

    def wake(self, task: _Task) -> None:
        at = math.inf
        if task.phase == "io":
            at = self.now + task.phase_left
            if not self.idle(task):
                at = min(at, task.io_since + self.cfg.idle_detect_s)
        elif task.busy and task.rate > 0:
            at = self.now + min(task.remaining, task.phase_left) / task.rate
        if abs(at - task.wake_at) > EPS:
            task.token += 1
            task.wake_at = at
            if at < math.inf:
                self.push(at, "wake", task.sim.job.task_id, task.token)

    # --- events -------------------------------------------------------------------------

    def handle(self, kind: Kind, task_id: str, token: int) -> None:
        self.dirty |= kind != "wake"
        if kind == "tick":
            self.push(self.now + self.cfg.tick_s, "tick")
            return
        if kind == "maint":
            self.maintain()
            return
        if kind == "maint_end":
            self.phase[task_id] = "up"
            return
        if kind == "arrive":
            sim = self.by_id[task_id]
            new = _Task(sim=sim, remaining=sim.duration_s, queued_at=self.now)
            self.tasks[task_id] = new
            self.queue[task_id] = new
            self.arrivals_left -= 1
            self.last_progress = self.now
            return
        task = self.running.get(task_id)
        if task is None or (kind != "wake" and task.attempt != token):
            return
        if kind == "stop":
            self.stop(task, failed=False)
        elif kind == "fail":
            self.c.failures += 1
            self.stop(task, failed=True)
        # "wake": step_states() does the work; a stale token is harmless

    def start(self, task: _Task, place: Place) -> None:
        del self.queue[task.sim.job.task_id]
        staged = self.staged.pop(task.sim.job.task_id, None)
        task.node_id, task.gpu_ids, task.milli = place.node_id, place.gpu_ids, place.gpu_milli
        task.lender = place.lender
        task.started_at = self.now
        task.first_start = self.now if task.first_start is None else task.first_start
        # Inputs staged on this node cost nothing at the start, a copy still under way
        # there only its rest; anywhere else the whole copy.
        stage_s = task.sim.stage_s
        if staged is not None and place.node_id in staged:
            stage_s = min(stage_s, max(0.0, staged[place.node_id] - self.now))
        task.phase, task.io_since, task.idle_seen = "busy", self.now, False
        task.phase_left = task.sim.io_every_s if task.sim.io_every_s > 0 else math.inf
        task.staging, task.computing_since = False, self.now
        if stage_s > EPS:
            task.phase, task.phase_left = "io", stage_s
            task.staging, task.computing_since = True, None
        task.paused = task.stopping = False
        task.paused_at, task.stopping_for = None, ""
        task.ckpt_at, task.ckpt_remaining = None, task.remaining
        task.attempt_remaining = task.remaining
        interval = task.sim.checkpoint_s
        task.next_ckpt = self.now + interval if interval > 0 else math.inf
        task.view, task.wake_at = None, math.inf
        self.running[task.sim.job.task_id] = task
        self.last_progress = self.now
        if self.cfg.failure_mtbf_h > 0:
            ttf = self.rng.expovariate(1.0 / (self.cfg.failure_mtbf_h * 3600.0))
            self.push(self.now + ttf, "fail", task.sim.job.task_id, task.attempt)

    # --- maintenance (SimConfig.maintenance) --------------------------------------------

    def maintain(self) -> None:
        """The nightly reset begins on every node."""
        cfg = self.cfg.maintenance
        assert cfg is not None
        self.next_maintenance = self.now + DAY_S
        self.push(self.next_maintenance, "maint")
        for node_id, phase in self.phase.items():
            if phase != "up":
                continue  # still in last night's (a node that never emptied)
            if cfg.mode == "cron":
                for task in [t for t in self.running.values() if t.node_id == node_id]:
                    self.c.maintenance_kills += 1
                    self.stop(task, failed=True)
                self.phase[node_id] = "command"
                self.push(self.now + cfg.command_s, "maint_end", node_id)
            else:
                self.phase[node_id] = "evacuating"
                self.command_when_empty(node_id)

    def command_when_empty(self, node_id: str) -> None:
        cfg = self.cfg.maintenance
        if cfg is None or self.phase.get(node_id) != "evacuating":
            return
        if not any(t.node_id == node_id for t in self.running.values()):
            self.phase[node_id] = "command"
            self.push(self.now + cfg.command_s, "maint_end", node_id)

    def nodes(self) -> tuple[Node, ...]:
        """The nodes as the policy sees them now: in a reset, taking no work (evacuated in
        window mode); in window mode, within the lead, their window's nearness."""
        cfg = self.cfg.maintenance
        if cfg is None:
            return self.trace.nodes
        near = self.next_maintenance - self.now
        window_in_s = near if cfg.mode == "window" and near <= cfg.lead_s else None
        out = []
        for node in self.trace.nodes:
            phase = self.phase[node.node_id]
            if phase == "up":
                out.append(node if window_in_s is None else
                           msgspec.structs.replace(node, window_in_s=max(0.0, window_in_s)))
            else:
                out.append(msgspec.structs.replace(
                    node, schedulable=False, draining=phase == "evacuating",
                    evacuating=phase == "evacuating"))
        return tuple(out)

    def release(self, task: _Task) -> None:
        task_id = task.sim.job.task_id
        del self.running[task_id]
        task.token += 1  # its pending wake-ups are stale now
        for other in self.running.values():
            if other.lender == task_id:  # the backfill keeps the capacity it borrowed
                other.lender, other.view = "", None
        self.command_when_empty(task.node_id)

    def finish(self, task: _Task) -> None:
        self.dirty = True
        self.release(task)
        task.end = self.now
        self.last_progress = self.now
        self.jobs_done += 1
        if self.on_progress is not None:
            self.on_progress(self.jobs_done, self.jobs_total)

    def stop(self, task: _Task, *, failed: bool) -> None:
        """Preempted (grace over) or crashed: back to its checkpoint, requeued."""
        if not failed:
            self.c.preemptions += 1
            task.preempted += 1
            task.fruitless = 0 if task.ckpt_at is not None else task.fruitless + 1
        lost = task.ckpt_remaining - task.remaining
        self.c.lost += lost * task.demand * len(task.gpu_ids) / MILLI_PER_GPU
        task.remaining = task.ckpt_remaining
        self.release(task)
        task.attained += task.held_gpu_s(self.now)
        task.attempt += 1
        self.queue[task.sim.job.task_id] = task

    # --- the policy ---------------------------------------------------------------------

    def decide(self) -> None:
        if not self.dirty:
            return
        self.dirty = False
        evacuating = any(p == "evacuating" for p in self.phase.values())
        if not self.queue and not evacuating and not any(
                t.paused or t.lender for t in self.running.values()):
            return
        state = ClusterState(nodes=self.nodes(),
                             running=tuple(self.view(t) for t in self.running.values()))
        queue = [self.queued(t) for t in self.queue.values()]
        self.c.calls += 1
        decisions = self.policy(state, queue, self.now)
        free = FreeMap(state, memory_overprovision=self.cfg.memory_overprovision)
        for decision in decisions:
            problem = self.apply(decision, free)
            if problem:
                self.c.rejected[problem] += 1

    def view(self, task: _Task) -> Running:
        if task.view is None:
            task.view = Running(
                job=self.job(task), node_id=task.node_id, gpu_ids=task.gpu_ids,
                gpu_milli=task.milli, started_at=task.started_at, queued_at=task.queued_at,
                attained_gpu_s=task.attained, last_checkpoint_at=task.ckpt_at,
                idle=self.idle(task), paused=task.paused, lender=task.lender,
                stopping=task.stopping, paused_at=task.paused_at,
                stopping_for=task.stopping_for, staging=task.staging,
                computing_since=task.computing_since)
        return task.view

    def queued(self, task: _Task) -> Queued:
        staged = self.staged.get(task.sim.job.task_id, {})
        on = tuple(node for node, at in staged.items() if at <= self.now)
        q = task.qview
        if q is None or q.job.attempt != task.attempt or q.staged_on != on:
            q = task.qview = Queued(job=self.job(task), queued_at=task.queued_at,
                                    attained_gpu_s=task.attained, staged_on=on)
        return q

    def job(self, task: _Task) -> Job:
        return msgspec.structs.replace(task.sim.job, attempt=task.attempt,
                                       fruitless_preemptions=task.fruitless)

    def apply(self, decision: Decision, free: FreeMap) -> str:
        """Apply one decision; a non-empty result says why it was refused."""
        if isinstance(decision, Place):
            task = self.queue.get(decision.task_id)
            if task is None or task.attempt != decision.attempt:
                return "place: not queued (or another attempt)"
            problem = self.check_fit(task, decision, free)
            if not problem:
                free.take(task.sim.job, decision.node_id, decision.gpu_ids,
                          decision.gpu_milli, borrowed=bool(decision.lender))
                self.start(task, decision)
            return problem
        if isinstance(decision, Stage):
            if decision.task_id not in self.queue or decision.node_id not in free.nodes:
                return "stage: not queued or no such node"
            sim = self.queue[decision.task_id].sim
            self.staged.setdefault(decision.task_id, {}).setdefault(
                decision.node_id, self.now + sim.stage_s)
            return ""
        if isinstance(decision, Preempt | Pause | Resume):
            task = self.running.get(decision.task_id)
            if task is None or task.attempt != decision.attempt:
                return f"{type(decision).__name__.lower()}: not running (or another attempt)"
            if isinstance(decision, Preempt) and not task.stopping:
                task.stopping, task.stopping_for, task.view = True, decision.for_task, None
                self.push(self.now + max(0.0, decision.grace_s), "stop",
                          decision.task_id, task.attempt)
            elif isinstance(decision, Pause | Resume) and not task.stopping:
                task.paused, task.view = isinstance(decision, Pause), None
                task.paused_at = self.now if task.paused else None
        return ""

    def check_fit(self, task: _Task, place: Place, free: FreeMap) -> str:
        job = task.sim.job
        if place.node_id not in free.nodes:
            return "place: no such node, or it takes no work"
        if not free.cpu_fits(job, place.node_id):
            return "place: CPU over capacity"
        need = gpus_needed(job)
        if len(place.gpu_ids) != need or len(set(place.gpu_ids)) != need:
            return "place: wrong number of GPUs"
        if need and place.gpu_milli < demand_milli(job):
            return "place: share smaller than asked"
        if place.lender:
            lender = self.running.get(place.lender)
            if lender is None or lender.node_id != place.node_id or not self.idle(lender) \
                    or not set(place.gpu_ids) <= set(lender.gpu_ids):
                return "place: lender not running idle on those GPUs"
            borrowed = sum(t.milli for t in self.running.values() if t.lender == place.lender)
            if borrowed + place.gpu_milli > lender.milli:
                return "place: backfill larger than the lender's share"
        known = {g.index for g in free.nodes[place.node_id].gpus}
        for index in place.gpu_ids:
            if index not in known:
                return "place: no such GPU"
            milli = 0 if place.lender else place.gpu_milli
            if not free.gpu_fits(job, place.node_id, index, milli):
                return "place: GPU over capacity, memory or wrong model"
        return ""

    def raw(self, horizon: float) -> RawRun:
        end = horizon if horizon < math.inf else self.now
        size = self.cfg.bucket_s
        samples = tuple(
            Sample(start_s=i * size, busy_gpus=b[0] / size, alloc_gpus=b[1] / size,
                   work_gpus=b[2] / size)
            for i, b in sorted(self.buckets.items()) if i * size < end)
        outcomes = tuple(self.outcome(t, end) for t in self.tasks.values())
        return RawRun(
            gpus=gpu_count(self.trace.nodes), span_s=end, busy_gpu_s=self.c.busy,
            alloc_gpu_s=self.c.alloc, work_gpu_s=self.c.work, lost_gpu_s=self.c.lost,
            held_staging_gpu_s=self.c.held_staging, held_io_gpu_s=self.c.held_io,
            held_unseen_gpu_s=self.c.held_unseen,
            preemptions=self.c.preemptions, failures=self.c.failures,
            maintenance_kills=self.c.maintenance_kills,
            policy_calls=self.c.calls, max_gpu_compute_milli=self.c.max_gpu_compute,
            rejected=dict(self.c.rejected), outcomes=outcomes, samples=samples,
            not_arrived=self.arrivals_left)

    def outcome(self, task: _Task, end: float) -> JobOutcome:
        sim, clock0 = task.sim, self.trace.clock0_s
        night = is_night(sim.submit_s, clock0) and sim.job.tier == "immediate"
        morning = next_morning(sim.submit_s, clock0) if night else None
        return JobOutcome(
            task_id=sim.job.task_id, kind=sim.kind, tier=sim.job.tier, submit_s=sim.submit_s,
            first_start_s=task.first_start, end_s=task.end, attempts=task.attempt,
            preemptions=task.preempted,
            night=night and morning is not None and morning <= end, morning_s=morning)


def simulate(trace: Trace, policy: Policy, cfg: SimConfig | None = None, *,
             on_progress: OnProgress | None = None) -> RawRun:
    """Replay `trace` under `policy`; deterministic for a given `cfg.seed`. `on_progress`
    is told (jobs finished, jobs in the run) after each job finishes, and once at the end."""
    return _Sim(trace, policy, cfg or SimConfig(), on_progress).run()
