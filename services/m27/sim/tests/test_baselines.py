"""Baseline policies on tiny hand-made scenarios: what each one does, and why."""

from __future__ import annotations

from m27.scheduler.model import ClusterState, Decision, Job, Place, Preempt, Queued, Running
from m27.sim import LabParams, SimConfig, generate_lab, make_nodes, simulate, summarize
from m27.sim._baselines import best_fit, fifo, slurm_backfill, tiresias
from m27.sim._byhand import ByHand
from m27.sim._policies import make_policy

HOUR = 3600.0


def q(task_id: str, milli: int, at: float = 0.0, attained: float = 0.0,
      urgency: str = "normal") -> Queued:
    job = Job(task_id=task_id, gpu_milli=milli, urgency=urgency)  # type: ignore[arg-type]
    return Queued(job=job, queued_at=at, attained_gpu_s=attained)


def run(task_id: str, gpus: tuple[int, ...], milli: int = 1000, started: float = 0.0,
        attained: float = 0.0) -> Running:
    job = Job(task_id=task_id, gpu_milli=milli * len(gpus) if milli == 1000 else milli)
    return Running(job=job, node_id="n000", gpu_ids=gpus, gpu_milli=milli,
                   started_at=started, attained_gpu_s=attained)


def placed(decisions: list[Decision]) -> dict[str, tuple[int, ...]]:
    return {d.task_id: d.gpu_ids for d in decisions if isinstance(d, Place)}


def state(gpus: int, *running: Running) -> ClusterState:
    return ClusterState(nodes=make_nodes(1, gpus), running=running)


def test_fifo_head_of_line_blocks_and_best_fit_does_not() -> None:
    s = state(2, run("r", (0,)))
    queue = [q("big", 2000, at=1.0), q("small", 1000, at=2.0)]
    assert placed(fifo(s, queue, 10.0)) == {}
    assert placed(best_fit(s, queue, 10.0)) == {"small": (1,)}


def test_fifo_gives_a_share_a_whole_gpu_best_fit_packs_shares() -> None:
    queue = [q("a", 300, at=1.0), q("b", 300, at=2.0)]
    fifo_places = [d for d in fifo(state(1), queue, 0.0) if isinstance(d, Place)]
    assert [(d.task_id, d.gpu_milli) for d in fifo_places] == [("a", 1000)]
    assert placed(best_fit(state(1), queue, 0.0)) == {"a": (0,), "b": (0,)}


def test_best_fit_puts_a_share_on_the_tightest_gpu() -> None:
    s = state(2, run("x", (0,), milli=400), run("y", (1,), milli=600))
    assert placed(best_fit(s, [q("s", 300)], 0.0)) == {"s": (1,)}


def test_slurm_backfills_only_what_ends_before_the_reservation() -> None:
    s = state(2, run("r", (0,), started=0.0))
    policy = slurm_backfill({"r": 100.0, "top": 50.0, "short": 50.0, "long": 500.0})
    queue = [q("top", 2000, at=0.0), q("short", 1000, at=5.0), q("long", 1000, at=1.0)]
    assert placed(policy(s, queue, 10.0)) == {"short": (1,)}


def test_slurm_orders_by_urgency_then_age() -> None:
    policy = slurm_backfill({})
    queue = [q("old", 1000, at=0.0), q("urgent", 1000, at=50.0, urgency="urgent")]
    assert placed(policy(state(1), queue, 60.0)) == {"urgent": (0,)}


def test_tiresias_preempts_the_most_served_for_a_new_job() -> None:
    s = state(2, run("long", (0,), started=0.0, attained=10 * HOUR),
              run("young", (1,), started=0.0))
    decisions = tiresias(threshold_gpu_s=HOUR)(s, [q("new", 1000, at=600.0)], 700.0)
    preempts = [d for d in decisions if isinstance(d, Preempt)]
    assert [(p.task_id, p.for_task) for p in preempts] == [("long", "new")]
    stopping = state(2, Running(job=Job(task_id="long", gpu_milli=1000), node_id="n000",
                                gpu_ids=(0,), gpu_milli=1000, started_at=0.0,
                                attained_gpu_s=10 * HOUR, stopping=True),
                     run("young", (1,), started=0.0))
    again = tiresias(threshold_gpu_s=HOUR)(stopping, [q("new", 1000, at=600.0)], 710.0)
    assert not [d for d in again if isinstance(d, Preempt)]  # the GPU is already coming


def test_tiresias_does_not_preempt_for_a_well_served_job() -> None:
    s = state(1, run("long", (0,), started=0.0, attained=10 * HOUR))
    decisions = tiresias(threshold_gpu_s=HOUR)(s, [q("old", 1000, attained=5 * HOUR)], 700.0)
    assert not [d for d in decisions if isinstance(d, Preempt)]


def test_by_hand_notices_a_free_gpu_only_after_a_delay_and_only_by_day() -> None:
    hand = ByHand([], notice_s=1800.0)
    s, queue = state(1), [q("j", 1000)]
    assert placed(hand(s, queue, 10 * HOUR)) == {}  # just went free
    assert placed(hand(s, queue, 10 * HOUR + 600)) == {}  # < 0.5 × notice
    assert placed(hand(s, queue, 10 * HOUR + 2700)) == {"j": (0,)}  # > 1.5 × notice
    night = ByHand([], notice_s=1800.0)
    assert placed(night(s, queue, 22 * HOUR)) == {}
    assert placed(night(s, queue, 32 * HOUR)) == {}  # 08:00: nobody yet
    assert placed(night(s, queue, 33 * HOUR + 2700)) == {"j": (0,)}


def test_by_hand_scripts_run_at_night_at_once() -> None:
    hand = ByHand(["scripted"], notice_s=1800.0)
    queue = [q("manual", 1000, at=0.0), q("scripted", 1000, at=1.0)]
    assert placed(hand(state(1), queue, 22 * HOUR)) == {"scripted": (0,)}


def test_automation_beats_by_hand_on_the_lab_workload() -> None:
    trace = generate_lab(LabParams(nodes=1, gpus_per_node=2, hours=48.0, seed=1))
    cfg = SimConfig(horizon_s=48 * HOUR)
    hand = summarize(simulate(trace, make_policy("by-hand", trace), cfg), policy="h", trace="")
    packed = summarize(simulate(trace, make_policy("best-fit", trace), cfg), policy="b",
                       trace="")
    assert packed.utilization > hand.utilization
    assert packed.completed > hand.completed
