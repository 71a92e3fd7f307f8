"""Engine invariants: every job completes once, no GPU over capacity, virtual time never goes
back, goodput ≤ utilization ≤ 1, the interference cap, preemption and failure semantics."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m27.common.config import NodeSection
from m27.scheduler.model import (
    MILLI_PER_GPU,
    ClusterState,
    Decision,
    Job,
    Place,
    Policy,
    Preempt,
    Queued,
    Stage,
)
from m27.sim import (
    MaintenanceSim,
    SimConfig,
    SimJob,
    Trace,
    make_nodes,
    make_policy,
    simulate,
    summarize,
)
from m27.sim._capacity import FreeMap, demand_milli, gpus_needed


def first_fit(state: ClusterState, queue: Sequence[Queued], now: float) -> list[Decision]:
    """Stand-in for m27's policy: each job, oldest first, on the first capacity that fits."""
    free = FreeMap(state)
    out: list[Decision] = []
    for q in sorted(queue, key=lambda q: q.queued_at):
        job, need = q.job, gpus_needed(q.job)
        milli = demand_milli(job) if need == 1 else MILLI_PER_GPU
        for node_id in free.nodes:
            gpus = tuple(free.free_gpus(job, node_id, milli))[:need] if need else ()
            if len(gpus) == need and free.cpu_fits(job, node_id):
                free.take(job, node_id, gpus, milli if need else 0)
                out.append(Place(task_id=job.task_id, attempt=job.attempt, node_id=node_id,
                                 gpu_ids=gpus, gpu_milli=milli if need else 0, reason="ff"))
                break
    return out


class Watch:
    """Wraps a policy and checks what the engine shows it at every call."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.times = policy, [0.0]

    def __call__(self, state: ClusterState, queue: Sequence[Queued],
                 now: float) -> list[Decision]:
        assert now >= self.times[-1], "virtual time went back"
        self.times.append(now)
        held: dict[tuple[str, int], int] = {}
        for run in state.running:
            for index in run.gpu_ids:
                key = (run.node_id, index)
                held[key] = held.get(key, 0) + (0 if run.lender else run.gpu_milli)
        assert all(v <= MILLI_PER_GPU for v in held.values()), held
        running = {r.job.task_id for r in state.running}
        assert running.isdisjoint(q.job.task_id for q in queue)
        return self.policy(state, queue, now)


def sim_job(task_id: str, *, at: float = 0.0, duration: float = 100.0, milli: int = 1000,
            io_every: float = 0.0, io_s: float = 0.0, ckpt: float = 0.0,
            urgency: str = "normal") -> SimJob:
    job = Job(task_id=task_id, gpu_milli=milli, urgency=urgency,  # type: ignore[arg-type]
              checkpoints=ckpt > 0, preemptible=True)
    return SimJob(job=job, submit_s=at, duration_s=duration, io_every_s=io_every, io_s=io_s,
                  checkpoint_s=ckpt)


jobs_strategy = st.lists(
    st.tuples(st.floats(0, 5000), st.floats(1, 3000), st.sampled_from([0, 200, 500, 1000, 2000]),
              st.sampled_from([0.0, 60.0, 300.0]), st.sampled_from([0.0, 20.0, 120.0])),
    min_size=1, max_size=25)


@settings(max_examples=30, deadline=None)
@given(jobs=jobs_strategy, policy=st.sampled_from(["first-fit", "fifo", "best-fit", "slurm",
                                                    "tiresias"]))
def test_invariants_hold_for_random_traces(
        jobs: list[tuple[float, float, int, float, float]], policy: str) -> None:
    """Each job completes exactly once, no GPU is over capacity, time is monotone and
    goodput ≤ utilization ≤ allocation ≤ 1 (CPU-only jobs included)."""
    sims = tuple(sim_job(f"j{i}", at=at, duration=d, milli=m, io_every=every,
                         io_s=io if every else 0.0, ckpt=100.0)
                 for i, (at, d, m, every, io) in enumerate(jobs))
    trace = Trace(name="t", nodes=make_nodes(2, 2), jobs=sims)
    inner = first_fit if policy == "first-fit" else make_policy(policy, trace)
    raw = simulate(trace, Watch(inner), SimConfig(tick_s=300.0))
    ends = [o.end_s for o in raw.outcomes]
    assert len(raw.outcomes) == len(sims)
    assert all(e is not None for e in ends)
    m = summarize(raw, policy=policy, trace="t")
    assert m.completed == len(sims)
    assert m.goodput <= m.utilization + 1e-9 <= m.allocation + 2e-9 <= 1.0 + 3e-9
    assert raw.max_gpu_compute_milli <= MILLI_PER_GPU + 1e-6
    assert raw.held_staging_gpu_s + raw.held_io_gpu_s <= raw.alloc_gpu_s + 1e-6
    assert raw.held_unseen_gpu_s <= raw.held_staging_gpu_s + raw.held_io_gpu_s + 1e-6
    assert raw.busy_gpu_s + raw.held_unseen_gpu_s <= raw.gpus * raw.span_s + 1e-6
    assert not raw.rejected
    for o, s in zip(sorted(raw.outcomes, key=lambda o: o.task_id),
                    sorted(sims, key=lambda s: s.job.task_id), strict=True):
        assert o.end_s is not None
        assert o.end_s >= s.submit_s + s.duration_s - 1e-6


def test_the_simulated_idle_detection_is_the_agents_default() -> None:
    node = NodeSection()
    assert SimConfig().idle_detect_s == pytest.approx(node.idle_samples * node.sample_interval)


def test_gpu_time_held_while_staging_and_in_io_is_counted() -> None:
    """A half GPU that stages 600 s, computes 2 × 600 s with one 100 s I/O phase between."""
    job = msgspec.structs.replace(sim_job("j", at=0.0, duration=1200.0, milli=500,
                                          io_every=600.0, io_s=100.0), stage_s=600.0)
    trace = Trace(name="t", nodes=make_nodes(1, 1), jobs=(job,))
    cfg = SimConfig(tick_s=300.0)
    raw = simulate(trace, make_policy("m27", trace), cfg)
    assert raw.held_staging_gpu_s == pytest.approx(0.5 * 600.0)
    assert raw.held_io_gpu_s == pytest.approx(0.5 * 100.0)
    # the first `idle_detect_s` of each pass before anything could be lent into it
    assert raw.held_unseen_gpu_s == pytest.approx(0.5 * 2 * cfg.idle_detect_s)
    assert raw.alloc_gpu_s == pytest.approx(0.5 * (600.0 + 1200.0 + 100.0))


class Backfill:
    """Starts B into A's idle share once A is seen idle, and never pauses it."""

    def __call__(self, state: ClusterState, queue: Sequence[Queued],
                 now: float) -> list[Decision]:
        running = {r.job.task_id: r for r in state.running}
        out: list[Decision] = []
        for q in queue:
            if q.job.task_id == "A":
                out.append(Place(task_id="A", attempt=q.job.attempt, node_id="n000",
                                 gpu_ids=(0,), gpu_milli=1000, reason="main"))
            elif "A" in running and running["A"].idle:
                out.append(Place(task_id="B", attempt=q.job.attempt, node_id="n000",
                                 gpu_ids=(0,), gpu_milli=1000, reason="backfill",
                                 lender="A"))
        return out


def test_colocated_tasks_share_one_gpu_of_compute() -> None:
    """A backfill still running when its lender is busy again halves both speeds: the GPU
    never delivers more than one GPU's worth of compute."""
    trace = Trace(name="t", nodes=make_nodes(1, 1), jobs=(
        sim_job("A", duration=200.0, io_every=100.0, io_s=50.0),
        sim_job("B", at=1.0, duration=100.0)))
    raw = simulate(trace, Backfill(), SimConfig(idle_detect_s=15.0))
    ends = {o.task_id: o.end_s for o in raw.outcomes}
    # A busy 0–100, I/O 100–150; B starts at 115 (idle seen), alone until 150 (35 s done);
    # then both busy at half speed: B's last 65 s take 130 s, then A's last 35 s alone.
    assert ends["B"] == pytest.approx(280.0)
    assert ends["A"] == pytest.approx(315.0)
    assert raw.max_gpu_compute_milli == pytest.approx(1000.0)
    m = summarize(raw, policy="x", trace="t")
    assert m.goodput == pytest.approx(300.0 / 315.0)
    assert m.utilization == pytest.approx((315.0 - 15.0) / 315.0)


class PreemptForUrgent:
    """Runs L; when U arrives, preempts L with a 10 s grace; then first-fit."""

    def __init__(self) -> None:
        self.seen: list[Queued] = []

    def __call__(self, state: ClusterState, queue: Sequence[Queued],
                 now: float) -> list[Decision]:
        self.seen.extend(q for q in queue if q.job.task_id == "L")
        waiting_urgent = any(q.job.urgency == "urgent" for q in queue)
        out: list[Decision] = [Preempt(task_id=r.job.task_id, attempt=r.job.attempt,
                                       reason="urgent", grace_s=10.0, for_task="U")
                               for r in state.running
                               if waiting_urgent and r.job.task_id == "L" and not r.stopping]
        return out + first_fit(state, [q for q in queue if not waiting_urgent
                                       or q.job.urgency == "urgent"], now)


def test_preempted_task_loses_work_since_checkpoint_and_keeps_its_queue_time() -> None:
    policy = PreemptForUrgent()
    trace = Trace(name="t", nodes=make_nodes(1, 1), jobs=(
        sim_job("L", duration=1000.0, ckpt=100.0),
        sim_job("U", at=250.0, duration=50.0, urgency="urgent")))
    raw = simulate(trace, policy, SimConfig())
    out = {o.task_id: o for o in raw.outcomes}
    # L stops at 260 with its checkpoint at 200: 60 s lost; U runs 260–310; L redoes 800 s.
    assert raw.preemptions == 1
    assert raw.lost_gpu_s == pytest.approx(60.0)
    assert out["U"].end_s == pytest.approx(310.0)
    assert out["L"].end_s == pytest.approx(310.0 + 800.0)
    assert out["L"].attempts == 2
    requeued = [q for q in policy.seen if q.job.attempt == 2]
    assert requeued
    assert all(q.queued_at == 0.0 for q in requeued)
    assert all(q.attained_gpu_s == pytest.approx(260.0) for q in requeued)


def test_failures_requeue_and_every_job_still_completes_once() -> None:
    sims = tuple(sim_job(f"j{i}", at=60.0 * i, duration=3600.0, ckpt=300.0) for i in range(6))
    trace = Trace(name="t", nodes=make_nodes(1, 2), jobs=sims)
    raw = simulate(trace, first_fit, SimConfig(failure_mtbf_h=0.5, seed=3))
    assert raw.failures > 0
    assert sum(o.attempts - 1 for o in raw.outcomes) == raw.failures
    assert all(o.end_s is not None for o in raw.outcomes)
    m = summarize(raw, policy="ff", trace="t")
    assert m.goodput < m.utilization  # redone work is busy time but not goodput


def test_progress_counts_each_finished_job_once_and_ends_with_the_total() -> None:
    sims = tuple(sim_job(f"j{i}", at=60.0 * i, duration=3600.0, ckpt=300.0) for i in range(6))
    trace = Trace(name="t", nodes=make_nodes(1, 2), jobs=sims)
    told: list[tuple[int, int]] = []
    raw = simulate(trace, first_fit, SimConfig(failure_mtbf_h=0.5, seed=3),
                   on_progress=lambda done, total: told.append((done, total)))
    assert raw.failures > 0  # failed attempts are not finished jobs
    assert [done for done, _ in told[:-1]] == list(range(1, 7))
    assert told[-1] == (6, 6)
    assert {total for _, total in told} == {6}
    cut: list[tuple[int, int]] = []
    simulate(trace, first_fit, SimConfig(horizon_s=3000.0), on_progress=lambda *a: cut.append(a))
    assert cut == [(0, 6)]  # the horizon came before any job ended: said once, at the end


def test_same_seed_same_result_and_horizon_stops_the_clock() -> None:
    sims = tuple(sim_job(f"j{i}", at=100.0 * i, duration=5000.0) for i in range(8))
    trace = Trace(name="t", nodes=make_nodes(1, 2), jobs=sims)
    cfg = SimConfig(horizon_s=7200.0, failure_mtbf_h=2.0, seed=5)
    a, b = simulate(trace, first_fit, cfg), simulate(trace, first_fit, cfg)
    assert a == b
    assert a.span_s == 7200.0
    assert a.busy_gpu_s <= 2 * 7200.0 + 1e-6
    assert any(o.end_s is None for o in a.outcomes)


def test_invalid_decisions_are_refused_and_counted() -> None:
    def greedy(state: ClusterState, queue: Sequence[Queued], now: float) -> list[Decision]:
        return [Place(task_id=q.job.task_id, attempt=q.job.attempt, node_id="n000",
                      gpu_ids=(0,), gpu_milli=1000, reason="all on GPU 0") for q in queue]

    trace = Trace(name="t", nodes=make_nodes(1, 2), jobs=(sim_job("a"), sim_job("b")))
    raw = simulate(trace, greedy, SimConfig())
    assert raw.rejected.get("place: GPU over capacity, memory or wrong model", 0) >= 1
    assert raw.max_gpu_compute_milli <= MILLI_PER_GPU
    assert all(o.end_s is not None for o in raw.outcomes)


def test_m27_policy_keeps_the_invariants_when_installed() -> None:
    """Runs the real m27 policy (whatever m27.scheduler.policy holds now)."""
    if not hasattr(importlib.import_module("m27.scheduler.policy"), "decide"):
        pytest.skip("m27.scheduler.policy.decide is not there yet")
    sims = tuple(sim_job(f"j{i}", at=200.0 * i, duration=900.0 + 100 * i,
                         milli=(300, 1000, 500, 2000)[i % 4], io_every=120.0, io_s=60.0,
                         ckpt=300.0) for i in range(12))
    trace = Trace(name="t", nodes=make_nodes(2, 2), jobs=sims)
    raw = simulate(trace, Watch(make_policy("m27", trace)), SimConfig())
    m = summarize(raw, policy="m27", trace="t")
    assert m.completed == len(sims)
    assert m.goodput <= m.utilization + 1e-9 <= 1.0
    assert raw.max_gpu_compute_milli <= MILLI_PER_GPU + 1e-6


class StageThenPlace:
    """Stages "j" on `stage_on` at once, places it on n000 GPU 0 from `place_at` on, and
    records the nodes the engine calls it staged on."""

    def __init__(self, stage_on: tuple[str, ...], place_at: float) -> None:
        self.stage_on, self.place_at = stage_on, place_at
        self.seen: list[tuple[float, tuple[str, ...]]] = []

    def __call__(self, state: ClusterState, queue: Sequence[Queued],
                 now: float) -> list[Decision]:
        out: list[Decision] = []
        for q in queue:
            self.seen.append((now, q.staged_on))
            out += [Stage(task_id="j", node_id=n, reason="pool") for n in self.stage_on]
            if now >= self.place_at:
                out.append(Place(task_id="j", attempt=q.job.attempt, node_id="n000",
                                 gpu_ids=(0,), gpu_milli=1000, reason="now"))
        return out


@pytest.mark.parametrize(("stage_on", "place_at", "staging"), [
    (("n000", "n001"), 200.0, 400.0),  # a copy under way there costs only its rest
    (("n001",), 200.0, 600.0),  # staged elsewhere: the whole copy
    (("n000",), 700.0, 0.0),  # staged there: none
    ((), 0.0, 600.0),
])
def test_a_start_on_a_staged_node_copies_only_what_is_not_staged_yet(
        stage_on: tuple[str, ...], place_at: float, staging: float) -> None:
    job = msgspec.structs.replace(sim_job("j", duration=100.0), stage_s=600.0)
    trace = Trace(name="t", nodes=make_nodes(2, 1), jobs=(job,))
    policy = StageThenPlace(stage_on, place_at)
    raw = simulate(trace, policy, SimConfig(tick_s=100.0))
    assert raw.held_staging_gpu_s == pytest.approx(staging)
    (outcome,) = raw.outcomes
    assert outcome.end_s == pytest.approx(place_at + staging + 100.0)
    # the queue shows a node as staged only once its copy is done, on every staged node
    ready = {nodes for at, nodes in policy.seen if at >= 600.0}
    assert ready <= {tuple(stage_on)}
    assert all(not nodes for at, nodes in policy.seen if at < 600.0)


# -- maintenance: the lab's cron reset against m27's window (SimConfig.maintenance) ------

THREE_AM = 3 * 3600.0


def test_a_cron_reset_kills_what_runs_and_it_starts_over() -> None:
    trace = Trace(name="t", nodes=make_nodes(1, 1), jobs=(sim_job("long", duration=36_000.0),))
    cron = MaintenanceSim(mode="cron", at_s=THREE_AM, command_s=120.0)
    raw = simulate(trace, first_fit, SimConfig(maintenance=cron))
    out = raw.outcomes[0]
    assert raw.maintenance_kills == 1
    assert raw.lost_gpu_s == pytest.approx(THREE_AM)  # no checkpoint: all of it redone
    assert out.end_s == pytest.approx(THREE_AM + 120.0 + 36_000.0)


def test_a_window_keeps_work_that_would_be_cut_short_away_and_loses_nothing() -> None:
    plain = Trace(name="t", nodes=make_nodes(2, 1), jobs=(sim_job("long", duration=36_000.0),))
    window = MaintenanceSim(mode="window", at_s=THREE_AM, command_s=120.0, lead_s=4 * 3600.0)
    raw = simulate(plain, make_policy("m27", plain), SimConfig(maintenance=window))
    out = raw.outcomes[0]
    assert (raw.lost_gpu_s, raw.maintenance_kills, raw.preemptions) == (0.0, 0, 0)
    assert out.first_start_s is not None
    assert out.first_start_s >= THREE_AM + 120.0  # it waited for the reset, not into it


def test_a_window_moves_checkpointing_work_losing_at_most_an_interval() -> None:
    trace = Trace(name="t", nodes=make_nodes(1, 1),
                  jobs=(sim_job("ckpt", duration=36_000.0, ckpt=300.0),))
    window = MaintenanceSim(mode="window", at_s=THREE_AM, command_s=120.0)
    raw = simulate(trace, Watch(make_policy("m27", trace)), SimConfig(maintenance=window))
    out = raw.outcomes[0]
    assert raw.maintenance_kills == 0
    assert raw.preemptions == 1  # checkpointed and stopped at the window
    assert raw.lost_gpu_s <= 300.0 + 60.0  # one interval, and the stop's grace
    assert out.end_s is not None
    assert out.attempts == 2
