"""m27's policy over whole random workloads, simulated to completion (hypothesis), and the
minimal case of the preemption livelock kept as a regression test (docs/scheduling.md,
"Thrash"). Properties, for every drawn trace:

- every job that FIFO finishes, m27 finishes;
- m27's goodput is at least FIFO's minus a small tolerance;
- preemptions per job stay bounded;
- no queued task waits while free capacity it fits sits unused for longer than a bound
  (a preemption's grace period plus two policy calls: capacity held for a preemptor).

`bench/policy_properties.py` runs the same properties over many more examples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m27.scheduler.model import (
    MILLI_PER_GPU,
    ClusterState,
    Decision,
    Job,
    Place,
    Policy,
    PolicySettings,
    Queued,
    Tier,
)
from m27.sim import SimConfig, SimJob, Trace, make_nodes, make_policy, simulate, summarize
from m27.sim._capacity import FreeMap, demand_milli, gpus_needed
from m27.sim._traces import read_jsonl
from m27.sim._workload import expected_wall_s

HERE = Path(__file__).parent
#: m27 may keep this much less work than FIFO by FIFO's end (a share of the GPU time):
#: priority order can start a long job first (list-scheduling anomalies), and a
#: preemption throws away the work since the victim's last checkpoint.
GOODPUT_TOLERANCE = 0.05
TICK_S = 60.0
MAX_JOBS = 24
TIERS: tuple[Tier, ...] = ("immediate", "background")


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    """1–4 nodes × 1–8 GPUs; shares from 0.1 GPU to gangs; GPU memory from 0 to the share's
    proportion; every tier, urgency and preemptibility; I/O every 0–900 s for 0–600 s,
    staging 0–600 s, checkpoints 0–900 s; arrivals at once, in waves, or spread. Half the
    draws are under pressure: one small node, background work that lends its idle share,
    and later waves of immediate work that wants it (where preemption storms start)."""
    pressure = draw(st.booleans())
    nodes = make_nodes(1 if pressure else draw(st.integers(1, 4)),
                       draw(st.sampled_from([1, 2] if pressure else [1, 2, 4, 8])),
                       cpu_milli=64_000)
    per_node = len(nodes[0].gpus)
    gpus = len(nodes) * per_node
    arrival = "waves" if pressure else draw(st.sampled_from(["once", "waves", "spread"]))
    # Enough jobs to contend for the GPUs: about two per GPU at most (at most 24 in all).
    count = draw(st.integers(1, min(MAX_JOBS, 2 * gpus + 2) + (6 if pressure else 0)))
    return Trace(name="drawn", nodes=nodes, jobs=tuple(sorted(
        (draw(_jobs(i, per_node, nodes[0].gpus[0].memory_mb, arrival, pressure))
         for i in range(count)), key=lambda j: j.submit_s)))


@st.composite
def _jobs(draw: st.DrawFn, i: int, per_node: int, gpu_memory_mb: int, arrival: str,
          pressure: bool) -> SimJob:
    tier = draw(st.sampled_from(TIERS))
    whole = draw(st.integers(1, per_node)) * MILLI_PER_GPU
    lends = pressure and tier == "background"  # a share that idles and has room to lend
    milli = draw(st.sampled_from([200, 300, 400, 500] if lends
                                 else [100, 200, 300, 400, 500, 700, 1000, whole]))
    share = min(milli, MILLI_PER_GPU) / MILLI_PER_GPU
    memory = int(draw(st.floats(0.0, 1.0)) * share * gpu_memory_mb)
    submit = {"once": 0.0, "spread": draw(st.floats(0.0, 4 * 3600.0)),
              "waves": 0.0 if lends else 3600.0 * draw(st.integers(0, 3))}[arrival]
    checkpoint = draw(st.sampled_from([0.0, 60.0, 300.0, 900.0]))
    io_every = draw(st.sampled_from([120.0, 300.0] if lends else [0.0, 120.0, 300.0, 900.0]))
    io_s = draw(st.sampled_from([60.0, 300.0, 600.0])) if io_every else 0.0
    job = Job(task_id=f"j{i}", gpu_milli=milli, gpu_memory_mb=memory,
              urgency=draw(st.sampled_from(["low", "normal", "high", "urgent"])),
              user=f"u{draw(st.integers(0, 2))}", tier=tier,
              preemptible=tier == "background" or draw(st.booleans()),
              checkpoints=checkpoint > 0, cpu_milli=1000)
    return SimJob(job=job, submit_s=submit, duration_s=draw(st.floats(300.0, 4 * 3600.0)),
                  io_every_s=io_every, io_s=io_s, checkpoint_s=checkpoint,
                  stage_s=draw(st.sampled_from([60.0, 180.0, 600.0] if lends
                                               else [0.0, 60.0, 180.0, 600.0])))


@dataclass
class Watch:
    """Wraps a policy; records how long each queued task has waited while free capacity it
    fits sat unused after the policy's decisions (held capacity excepted: see `_held`)."""

    inner: Policy
    since: dict[str, float] = field(default_factory=dict)
    worst: float = 0.0
    worst_task: str = ""

    def __call__(self, state: ClusterState, queue: Sequence[Queued],
                 now: float) -> list[Decision]:
        decisions = self.inner(state, queue, now)
        free = FreeMap(state)
        placed = set()
        for d in decisions:
            if isinstance(d, Place):
                placed.add(d.task_id)
                job = next(q.job for q in queue if q.job.task_id == d.task_id)
                free.take(job, d.node_id, d.gpu_ids, d.gpu_milli, borrowed=bool(d.lender))
        held = _held(state)
        for q in queue:
            task_id = q.job.task_id
            if task_id in placed or not _fits(free, q.job, held):
                self.since.pop(task_id, None)
                continue
            start = self.since.setdefault(task_id, now)
            if now - start > self.worst:
                self.worst, self.worst_task = now - start, task_id
        return decisions


def _held(state: ClusterState) -> set[tuple[str, int]]:
    """GPUs a stopping task is on: their free capacity is held for its preemptor."""
    return {(r.node_id, g) for r in state.running if r.stopping for g in r.gpu_ids}


def _fits(free: FreeMap, job: Job, held: set[tuple[str, int]]) -> bool:
    need = gpus_needed(job)
    milli = demand_milli(job) if need == 1 else MILLI_PER_GPU
    for node_id in free.nodes:
        if not free.cpu_fits(job, node_id):
            continue
        if need == 0:
            return True
        gpus = [g for g in free.free_gpus(job, node_id, milli) if (node_id, g) not in held]
        if len(gpus) >= need:
            return True
    return False


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_m27_finishes_what_fifo_finishes_without_thrash_or_idle_waiting(trace: Trace) -> None:
    check_properties(trace)


@dataclass(frozen=True)
class Findings:
    """What one trace shows under m27 against FIFO (the benchmark tallies these)."""

    unfinished: tuple[str, ...]  # jobs FIFO finished and m27 did not
    goodput: float  # m27's, over FIFO's span
    fifo_goodput: float
    worst_wait_s: float  # longest wait beside free capacity the task fits
    worst_wait_task: str
    over_bound: tuple[str, ...]  # jobs preempted more often than `preemption_bound`
    preemptions: tuple[int, ...]  # per job
    makespan_ratio: float  # m27's span / FIFO's
    jct_ratio: float | None  # m27's mean JCT / FIFO's


def measure(trace: Trace) -> Findings:
    cfg = SimConfig(tick_s=TICK_S, horizon_s=serial_bound(trace))
    fifo_raw = simulate(trace, make_policy("fifo", trace), cfg)
    watch = Watch(make_policy("m27", trace))
    raw = simulate(trace, watch, cfg)
    done_fifo = {o.task_id for o in fifo_raw.outcomes if o.end_s is not None}
    done = {o.task_id for o in raw.outcomes if o.end_s is not None}
    # Goodput over the same span, FIFO's: the work each has kept by the time FIFO is done.
    span = SimConfig(tick_s=TICK_S, horizon_s=fifo_raw.span_s)
    fifo = summarize(fifo_raw, policy="fifo", trace=trace.name)
    m27 = summarize(simulate(trace, make_policy("m27", trace), span), policy="m27",
                    trace=trace.name)
    whole = summarize(raw, policy="m27", trace=trace.name)
    by_id = {j.job.task_id: j for j in trace.jobs}
    return Findings(
        unfinished=tuple(sorted(done_fifo - done)), goodput=m27.goodput,
        fifo_goodput=fifo.goodput, worst_wait_s=watch.worst, worst_wait_task=watch.worst_task,
        over_bound=tuple(o.task_id for o in raw.outcomes
                         if o.preemptions > preemption_bound(by_id[o.task_id])),
        preemptions=tuple(o.preemptions for o in raw.outcomes),
        makespan_ratio=raw.span_s / fifo_raw.span_s if fifo_raw.span_s else 1.0,
        jct_ratio=(whole.mean_jct_s / fifo.mean_jct_s
                   if whole.mean_jct_s and fifo.mean_jct_s else None))


#: A queued task may wait beside free capacity it fits this long at most: the capacity is
#: held for a preemptor while its victims checkpoint (a grace period), plus two calls.
WAIT_BOUND_S = PolicySettings().preempt_grace_s + 2 * TICK_S


def check_properties(trace: Trace) -> None:
    """The module's properties for one trace."""
    f = measure(trace)
    assert not f.unfinished, f"m27 left {f.unfinished} unfinished"
    assert f.goodput >= f.fifo_goodput - GOODPUT_TOLERANCE, (f.goodput, f.fifo_goodput)
    assert f.worst_wait_s <= WAIT_BOUND_S, (f.worst_wait_task, f.worst_wait_s)
    assert not f.over_bound, f"preempted beyond their bound: {f.over_bound}"


def serial_bound(trace: Trace) -> float:
    """Every job one after the other from the last arrival on: no sane policy needs longer
    (a livelocked one would run for ever)."""
    return (max(j.submit_s for j in trace.jobs) + sum(expected_wall_s(j) for j in trace.jobs)
            + 3600.0)


def preemption_bound(sim: SimJob) -> int:
    """At most `max_fruitless_preemptions` in a row without progress, then one more per
    checkpoint that kept work: a checkpoint every `checkpoint_s` of running at the most."""
    settings_ = PolicySettings()
    limit = settings_.max_fruitless_preemptions + 1
    if sim.checkpoint_s <= 0:
        return limit
    wall = sim.duration_s + sim.stage_s + (sim.duration_s / sim.io_every_s * sim.io_s
                                           if sim.io_every_s else 0.0)
    return limit * (1 + math.ceil(wall / max(sim.checkpoint_s, settings_.min_runtime_s)))


def test_the_minimal_livelock_case_finishes_every_job_with_a_handful_of_preemptions() -> None:
    """Six background 0.4-GPU preprocessing tasks with I/O phases and staging, then an MD
    run an hour later, on one GPU. The old policy preempted 2,760 times in 24 h and finished
    2 of the 7 jobs; FIFO finishes all 7 with none."""
    trace = read_jsonl(HERE / "minimal_livelock.jsonl")
    raw = simulate(trace, make_policy("m27", trace), SimConfig(horizon_s=24 * 3600.0))
    assert all(o.end_s is not None for o in raw.outcomes)
    assert raw.preemptions <= 6
    fifo = simulate(trace, make_policy("fifo", trace), SimConfig(horizon_s=24 * 3600.0))
    m27_sum, fifo_sum = (summarize(r, policy="", trace="") for r in (raw, fifo))
    assert m27_sum.goodput >= fifo_sum.goodput - 0.005
    md = next(o for o in raw.outcomes if o.task_id == "md-0")
    assert md.attempts == 1  # not preemptible: it ran once, start to end


def test_a_ready_pool_task_is_not_left_behind_background_backfills() -> None:
    """One GPU: an MD run (not preemptible) writes its trajectory every 10 min, and two
    0.5-GPU sweeps fill its idle share at once, then stay paused in it between writes. A
    0.5-GPU training arrives an hour later. Before, the share stayed lent to the sweeps and
    the training waited for the MD run to end (7.5 h); now a sweep yields the share, and the
    training is done before the MD run is."""
    trace = read_jsonl(HERE / "ready_pool_behind_sweeps.jsonl")
    raw = simulate(trace, make_policy("m27", trace), SimConfig(horizon_s=24 * 3600.0))
    ends = {o.task_id: o.end_s for o in raw.outcomes}
    assert all(end is not None for end in ends.values())
    train, md = ends["train-0"], ends["md-0"]
    assert train is not None
    assert md is not None
    assert train < md
    assert raw.preemptions <= 2
    assert all(o.attempts == 1 for o in raw.outcomes if o.tier == "immediate")


def test_a_ready_pool_backfill_moves_to_capacity_of_its_own_when_it_frees() -> None:
    """Two GPUs: a long MD run with trajectory writes holds one, a 2-hour run the other. A
    4-hour training arrives and backfills into the MD run's idle share. When the other GPU
    frees it checkpoints and moves there; before, it crawled in the share until the MD run
    ended (12.3 h) and finished after it."""
    trace = read_jsonl(HERE / "ready_pool_moves.jsonl")
    raw = simulate(trace, make_policy("m27", trace), SimConfig(horizon_s=24 * 3600.0))
    by_id = {o.task_id: o for o in raw.outcomes}
    train, md = by_id["train-0"], by_id["md-0"]
    assert train.end_s is not None
    assert md.end_s is not None
    assert train.end_s < md.end_s
    assert (train.attempts, train.preemptions) == (2, 1)  # it moved once
    assert raw.preemptions == 1
