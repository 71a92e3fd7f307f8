"""Checks of one chaos schedule, from the records the system and its steps left: pure
functions of an `Evidence`, each returning violations as strings that name the seed, the
run, the step and what shows it."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import msgspec

from tests.chaos.schedule import Fault

#: Allowed time from a checkpoint being due to it being durable (a persist or an upload on
#: a loaded 2-core machine), on top of the checkpoint interval.
DURABLE_S: Final = 3.0
FINAL_RUN_STATES: Final = frozenset({"succeeded", "failed", "cancelled"})
#: Faults during which a checkpoint cannot become durable anywhere, or only slowly (a slow
#: disk); every nats_restart is one too (a cluster member's streams elect new leaders).
STORE_OUTAGES: Final = frozenset({("kill", "checkpoint-store"), ("freeze", "checkpoint-store"),
                                  ("disk_full", "checkpoint-store"),
                                  ("slow_disk", "checkpoint-store")})


class Mark(msgspec.Struct, frozen=True):
    """A line of a step's markers file: event, attempt, pid, node, wall time, value."""

    event: str
    attempt: int
    pid: int
    node: str
    t: float
    value: str = ""


class Effect(msgspec.Struct, frozen=True):
    attempt: int
    pid: int
    t: float


class Attempt(msgspec.Struct, frozen=True):
    """An attempt a step's record knows: the current one or one in its history."""

    attempt: int
    node: str | None
    cause: str


class StepView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    state: str
    attempt: int
    reason: str = ""
    history: tuple[Attempt, ...] = ()

    def known_attempts(self) -> set[int]:
        return {a.attempt for a in self.history} | {self.attempt}


class RunView(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    run_id: str
    state: str
    steps: tuple[StepView, ...] = ()


class StoredEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event M27_EVENTS held at the end, in stream order (`seq`)."""

    seq: int
    tag: str
    run_id: str = ""
    step: str = ""
    attempt: int = 0
    state: str = ""


class StaleProbe(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint written at the end in the name of an attempt older than the task's
    last one: `accepted` must be False."""

    label: str
    step: str
    attempt: int
    accepted: bool
    detail: str = ""


class FaultRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A fault as it was done: wall times of its start, its heal, and when the harness saw
    the target serving again (a restarted process ready, a node renewing its lease)."""

    fault: Fault
    started_at: float
    healed_at: float
    serving_at: float | None = None


class Evidence(msgspec.Struct, kw_only=True):
    seed: int
    runs: list[RunView]
    #: "<label>/<step>" → its markers and effects, parsed
    marks: dict[str, list[Mark]] = msgspec.field(default_factory=dict)
    effects: dict[str, list[Effect]] = msgspec.field(default_factory=dict)
    events: list[StoredEvent] = msgspec.field(default_factory=list)
    #: "<label>/<step>" → the final.sha256 it wrote ("" when none)
    digests: dict[str, str] = msgspec.field(default_factory=dict)
    reference_digest: str = ""
    probes: list[StaleProbe] = msgspec.field(default_factory=list)
    faults: list[FaultRecord] = msgspec.field(default_factory=list)
    #: "<label>/<step>" → its checkpoint interval (s), for the steps that have one
    intervals: dict[str, float] = msgspec.field(default_factory=dict)


class LostWork(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    attempt: int
    lost_s: float
    bound_s: float


def parse_marks(text: str) -> list[Mark]:
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 5:  # a line cut short by a kill has fewer fields: skipped
            found.append(Mark(parts[0], int(parts[1]), int(parts[2]), parts[3],
                              float(parts[4]), parts[5] if len(parts) > 5 else ""))
    return found


def parse_effects(text: str) -> list[Effect]:
    return [Effect(int(p[0]), int(p[1]), float(p[2]))
            for p in (line.split() for line in text.splitlines()) if len(p) == 3]


def _where(ev: Evidence, run: RunView, step: str = "") -> str:
    return f"seed {ev.seed}: run {run.label} ({run.run_id})" + (f" step {step}" if step else "")


def check_final(ev: Evidence) -> list[str]:
    """Every run ended, and succeeded (each of them succeeds without faults), every step
    with it."""
    found = []
    for run in ev.runs:
        if run.state not in FINAL_RUN_STATES:
            found.append(f"{_where(ev, run)} never ended: still {run.state}")
        elif run.state != "succeeded":
            failed = [f"{s.name} {s.state} (attempt {s.attempt}: {s.reason})"
                      for s in run.steps if s.state != "succeeded"]
            found.append(f"{_where(ev, run)} ended {run.state}; steps: {'; '.join(failed)}")
    return found


def spans(marks: Iterable[Mark]) -> dict[tuple[int, int], tuple[float, float]]:
    """(attempt, pid) → (first, last) time that process left a mark."""
    seen: dict[tuple[int, int], list[float]] = {}
    for m in marks:
        seen.setdefault((m.attempt, m.pid), []).append(m.t)
    return {k: (min(t), max(t)) for k, t in seen.items()}


def check_overlaps(ev: Evidence) -> list[str]:
    """No two attempts of a task ran at once, and no attempt ran twice (two processes
    that each started it), judged from the times the steps wrote."""
    found = []
    for run in ev.runs:
        for step in run.steps:
            marks = ev.marks.get(f"{run.label}/{step.name}", [])
            starts: dict[int, set[int]] = {}
            for m in marks:
                if m.event == "start":
                    starts.setdefault(m.attempt, set()).add(m.pid)
            for attempt, pids in sorted(starts.items()):
                if len(pids) > 1:
                    found.append(f"{_where(ev, run, step.name)}: attempt {attempt} started "
                                 f"by {len(pids)} processes {sorted(pids)}")
            ordered = sorted(spans(marks).items(), key=lambda kv: kv[1][0])
            for (k1, (s1, e1)), (k2, (s2, e2)) in itertools.combinations(ordered, 2):
                if k1[0] != k2[0] and s2 <= e1:
                    found.append(f"{_where(ev, run, step.name)}: attempts {k1[0]} (pid "
                                 f"{k1[1]}, {s1:.3f}–{e1:.3f}) and {k2[0]} (pid {k2[1]}, "
                                 f"{s2:.3f}–{e2:.3f}) ran at once")
    return found


def check_effects(ev: Evidence) -> tuple[list[str], int]:
    """A succeeded step's effect happened exactly once by the attempt the system counts,
    and no superseded attempt had its effect after its successor started. An effect of
    an attempt whose end the system never learnt (killed right after it) is redone by the
    next attempt: at-least-once, counted (second value), not a violation."""
    found, redone = [], 0
    for run in ev.runs:
        for step in run.steps:
            key = f"{run.label}/{step.name}"
            effects = ev.effects.get(key, [])
            starts = [m for m in ev.marks.get(key, []) if m.event == "start"]
            if step.state == "succeeded":
                own = [e for e in effects if e.attempt == step.attempt]
                if len(own) != 1:
                    found.append(f"{_where(ev, run, step.name)}: its succeeded attempt "
                                 f"{step.attempt} has {len(own)} effects {own}")
            for e in effects:
                if e.attempt == step.attempt:
                    continue
                later = [s.t for s in starts if s.attempt > e.attempt]
                if later and e.t > min(later):
                    found.append(f"{_where(ev, run, step.name)}: attempt {e.attempt} had "
                                 f"its effect at {e.t:.3f}, after attempt "
                                 f"{min(s.attempt for s in starts if s.attempt > e.attempt)}"
                                 f" started at {min(later):.3f}")
                else:
                    redone += 1
    return found, redone


def check_events(ev: Evidence) -> list[str]:
    """Nothing acknowledged was lost or forgotten: every task_started/task_exited the
    events stream holds is an attempt the run's record knows; every attempt that really
    ran (a launch or start marker) is known to the record; the last run_state_changed stored for
    a run is its final state."""
    found = []
    by_id = {run.run_id: run for run in ev.runs}
    last_state: dict[str, str] = {}
    for e in sorted(ev.events, key=lambda e: e.seq):
        run = by_id.get(e.run_id)
        if run is None:
            continue
        if e.tag == "run_state_changed":
            last_state[e.run_id] = e.state
        if e.tag in ("task_started", "task_exited"):
            step = next((s for s in run.steps if s.name == e.step), None)
            if step is None or e.attempt not in step.known_attempts():
                found.append(f"{_where(ev, run, e.step)}: stored {e.tag} (seq {e.seq}) of "
                             f"attempt {e.attempt} is not in the run's record")
    for run in ev.runs:
        if run.state in FINAL_RUN_STATES and last_state.get(run.run_id) != run.state:
            found.append(f"{_where(ev, run)}: ended {run.state} but the last stored "
                         f"run_state_changed says {last_state.get(run.run_id)}")
        for step in run.steps:
            ran = {m.attempt for m in ev.marks.get(f"{run.label}/{step.name}", [])
                   if m.event in ("launch", "start")}
            if unknown := ran - step.known_attempts():
                found.append(f"{_where(ev, run, step.name)}: attempts {sorted(unknown)} ran "
                             f"(start markers) but the record knows {step.known_attempts()}")
    return found


def check_stale_checkpoints(ev: Evidence) -> list[str]:
    """No checkpoint of a superseded attempt was accepted: the probes written at the end
    in an old attempt's name were refused, and no checkpoint_committed of an attempt was
    stored after a later attempt of its task had started."""
    found = [f"seed {ev.seed}: run {p.label} step {p.step}: a checkpoint in the name of "
             f"stale attempt {p.attempt} was accepted ({p.detail})"
             for p in ev.probes if p.accepted]
    newest: dict[tuple[str, str], int] = {}
    by_id = {run.run_id: run for run in ev.runs}
    for e in sorted(ev.events, key=lambda e: e.seq):
        task = (e.run_id, e.step)
        if e.tag == "task_started":
            newest[task] = max(newest.get(task, 0), e.attempt)
        elif e.tag == "checkpoint_committed" and e.attempt < newest.get(task, 0):
            run = by_id.get(e.run_id)
            label = run.label if run else e.run_id
            found.append(f"seed {ev.seed}: run {label} step {e.step}: a checkpoint of "
                         f"attempt {e.attempt} was committed (seq {e.seq}) after attempt "
                         f"{newest[task]} had started")
    return found


def check_digests(ev: Evidence) -> list[str]:
    """Each succeeded training step ends bitwise equal to the fault-free run."""
    found = []
    for run in ev.runs:
        for step in run.steps:
            key = f"{run.label}/{step.name}"
            if key in ev.digests and step.state == "succeeded" \
                    and ev.digests[key] != ev.reference_digest:
                found.append(f"{_where(ev, run, step.name)}: final state sha256 "
                             f"{ev.digests[key][:16] or '(none)'} differs from the "
                             f"fault-free {ev.reference_digest[:16]}")
    return found


def _overlap(a: float, b: float, windows: Iterable[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in windows)


def outage_windows(faults: Sequence[FaultRecord], node: str) -> list[tuple[float, float]]:
    """When a checkpoint of a task on `node` could not become durable (or only slowly): the
    store or a NATS server down, its disk full or slow, or the node itself (which uploads
    a program's files) out."""
    return [(f.started_at, max(f.healed_at, f.serving_at or 0.0)) for f in faults
            if (f.fault.kind, f.fault.target) in STORE_OUTAGES or f.fault.kind == "nats_restart"
            or (f.fault.target == node and f.fault.kind != "drain")]


def lost_work(ev: Evidence) -> tuple[list[LostWork], list[str]]:
    """Per failover of a checkpointed step: the time of work redone (from when attempt n
    first reached the progress attempt n+1 resumed from, to attempt n's last progress),
    against one checkpoint interval + DURABLE_S + the time a checkpoint could not be
    made durable (outage_windows). Resuming past what was done is a violation too."""
    losses, found = [], []
    for key, interval in ev.intervals.items():
        marks = ev.marks.get(key, [])
        attempts = sorted({m.attempt for m in marks if m.event == "start"})
        for prev, nxt in itertools.pairwise(attempts):
            resumed = next(int(m.value) for m in marks if m.event == "start"
                           and m.attempt == nxt)
            ticks = [m for m in marks if m.attempt == prev and m.event in ("start", "tick")]
            done = max((int(m.value or 0) for m in ticks), default=0)
            if resumed > done + 1:
                found.append(f"seed {ev.seed}: {key}: attempt {nxt} resumed at {resumed}, "
                             f"but attempt {prev} got only to {done}")
                continue
            reached = [m.t for m in ticks if int(m.value or 0) >= resumed]
            if not ticks or not reached:
                continue
            lost = max(m.t for m in ticks) - min(reached)
            node = ticks[0].node
            bound = interval + DURABLE_S + _overlap(min(reached), max(m.t for m in ticks),
                                                    outage_windows(ev.faults, node))
            losses.append(LostWork(key=key, attempt=prev, lost_s=round(lost, 3),
                                   bound_s=round(bound, 3)))
            if lost > bound:
                found.append(f"seed {ev.seed}: {key}: attempt {prev} lost {lost:.1f} s of "
                             f"work (resumed at {resumed} of {done}), more than {bound:.1f} s")
    return losses, found


def recovery_times(ev: Evidence) -> dict[str, list[float]]:
    """Per fault kind, seconds from the fault to recovery: for a fault that took a node's
    work away, the first start of a new attempt of each task that ran there just before
    (the affected work running again); otherwise when the harness saw the target serving
    again."""
    times: dict[str, list[float]] = {}
    for f in ev.faults:
        node_faulted = f.fault.target.startswith("node-") and f.fault.kind != "kill_guard"
        affected = {key for key, marks in ev.marks.items() if node_faulted and any(
            m.node == f.fault.target and f.started_at - 1.0 <= m.t <= f.started_at
            for m in marks)}
        recovered = []
        for key in affected:
            restarts = [m.t for m in ev.marks[key] if m.event == "start" and m.t > f.started_at]
            if restarts:
                recovered.append(min(restarts) - f.started_at)
        if not recovered and f.serving_at is not None:
            recovered.append(f.serving_at - f.started_at)
        times.setdefault(f.fault.kind, []).extend(round(r, 3) for r in recovered)
    return times


class Outcome(msgspec.Struct, kw_only=True):
    seed: int
    violations: list[str]
    lost: list[LostWork]
    recovery: dict[str, list[float]]
    redone_effects: int
    runs: int
    runs_succeeded: int
    faults: list[FaultRecord]
    #: seconds each phase of the schedule took (start, faults, settle, gather)
    phases: dict[str, float] = msgspec.field(default_factory=dict)


def check_all(ev: Evidence) -> Outcome:
    effects, redone = check_effects(ev)
    losses, lost_violations = lost_work(ev)
    violations = [*check_final(ev), *check_overlaps(ev), *effects, *check_events(ev),
                  *check_stale_checkpoints(ev), *check_digests(ev), *lost_violations]
    return Outcome(seed=ev.seed, violations=violations, lost=losses,
                   recovery=recovery_times(ev), redone_effects=redone, runs=len(ev.runs),
                   runs_succeeded=sum(r.state == "succeeded" for r in ev.runs),
                   faults=list(ev.faults))


def count_by_kind(faults: Iterable[FaultRecord]) -> Mapping[str, int]:
    counts: dict[str, int] = {}
    for f in faults:
        counts[f.fault.kind] = counts.get(f.fault.kind, 0) + 1
    return counts
