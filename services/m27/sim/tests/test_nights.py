"""Which nights could be met (`m27.sim.night_demand`, `night_check`): a lower bound on the
work that must run 18:00–09:00, that sees a day that overflowed as well as one long job."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from m27.scheduler.model import Job
from m27.sim import JobOutcome, SimJob, Trace, make_nodes, night_check, night_demand

H = 3600.0
MORNING = 33 * H  # 09:00 on the second day (clock0 = midnight)


def sim(name: str, submit_h: float, hours: float, milli: int = 1000,
        tier: str = "immediate") -> SimJob:
    return SimJob(job=Job(task_id=name, gpu_milli=milli, tier=tier),  # type: ignore[arg-type]
                  submit_s=submit_h * H, duration_s=hours * H)


def trace(gpus: int, *jobs: SimJob) -> Trace:
    return Trace(name="t", nodes=make_nodes(1, gpus), jobs=jobs)


def test_a_day_that_overflowed_leaves_no_room_for_the_night() -> None:
    """Ten 2-hour runs at 09:00 on one GPU: 11 h of them are still queued at 18:00 however
    they are run. With a 5-hour night job that is 16 h of work for a 15-hour night."""
    day = [sim(f"day-{i}", 9 + 24, 2) for i in range(10)]
    night = sim("night", 19 + 24, 5)
    t = trace(1, *day, night)
    assert night_demand(t, MORNING + 24 * H) == (11 + 5) * H
    assert night_demand(trace(1, night), MORNING + 24 * H) == 5 * H
    # The same work on 16 GPUs fits easily: the fluid drains it before 18:00.
    assert night_demand(trace(16, *day, night), MORNING + 24 * H) == 5 * H


def test_one_long_day_job_counts_even_where_the_fluid_would_spread_it() -> None:
    """A 20-hour whole-GPU run from 17:00 needs its GPU until 09:00 (15 h after 18:00, up to
    the morning); the fluid alone would spread it over 16 GPUs and see nothing left."""
    t = trace(16, sim("long", 17, 20), sim("night", 20, 2))
    assert night_demand(t, MORNING) == (15 + 2) * H
    assert night_demand(trace(1, sim("long", 17, 20), sim("night", 20, 2)), MORNING) > 15 * H


def test_only_immediate_gpu_work_before_the_morning_counts() -> None:
    t = trace(1, sim("bg", 19, 5, tier="background"), sim("cpu", 19, 5, milli=0),
              sim("late", 33.5, 5), sim("half", 19, 4, milli=500))
    assert night_demand(t, MORNING) == 0.5 * 4 * H


def outcome(name: str, submit_h: float, end_h: float | None) -> JobOutcome:
    return JobOutcome(task_id=name, kind="", tier="immediate", submit_s=submit_h * H,
                      first_start_s=submit_h * H, end_s=None if end_h is None else end_h * H,
                      attempts=1, night=True, morning_s=MORNING)


def test_a_fitting_nights_jobs_count_unless_they_could_not_finish_alone() -> None:
    t = trace(1, sim("a", 19, 2), sim("b", 20, 3), sim("c", 23, 11))  # c alone: 10:00
    got = night_check(t, [outcome("a", 19, 21), outcome("b", 20, 34), outcome("c", 23, None)])
    assert (got.nights, got.nights_fit, got.jobs, got.done) == (1, 1, 2, 1)
    # Add a day that overflowed: the night no longer fits, and nothing is counted.
    day = [sim(f"day-{i}", 9, 2) for i in range(10)]
    full = trace(1, *day, sim("a", 19, 2), sim("b", 20, 3), sim("c", 23, 11))
    got = night_check(full, [outcome("a", 19, 21), outcome("b", 20, 34)])
    assert (got.nights, got.nights_fit, got.jobs, got.done) == (1, 0, 0, 0)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, list[SimJob]]:
    gpus = draw(st.sampled_from([1, 2, 8, 16]))
    jobs = [sim(f"j{i}", draw(st.floats(0, 32.9)), draw(st.floats(0.1, 24)),
                draw(st.sampled_from([200, 500, 1000, 2000])),
                draw(st.sampled_from(["immediate", "immediate", "background"])))
            for i in range(draw(st.integers(0, 20)))]
    return gpus, jobs


@settings(max_examples=200, deadline=None)
@given(workloads(), st.floats(0, 32.9), st.floats(0.1, 24))
def test_the_bound_only_grows_with_more_work_and_covers_the_night_alone(
        case: tuple[int, list[SimJob]], submit_h: float, hours: float) -> None:
    gpus, jobs = case
    before = night_demand(trace(gpus, *jobs), MORNING)
    after = night_demand(trace(gpus, *jobs, sim("extra", submit_h, hours)), MORNING)
    assert after >= before - 1e-6
    night = sum(min(j.duration_s, MORNING - j.submit_s) * (j.job.gpu_milli / 1000
                                                           if j.job.gpu_milli < 1000
                                                           else j.job.gpu_milli // 1000)
                for j in jobs if j.job.tier == "immediate" and j.submit_s >= MORNING - 15 * H)
    assert before >= night - 1e-6
