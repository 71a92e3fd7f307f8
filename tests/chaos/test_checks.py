"""The chaos schedule and checks alone (pure, milliseconds): a seed always draws the same
schedule, and each check finds the violation it is for and nothing in a clean record."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from tests.chaos import checks, schedule
from tests.chaos.checks import (
    Attempt,
    Effect,
    Evidence,
    FaultRecord,
    Mark,
    RunView,
    StaleProbe,
    StepView,
    StoredEvent,
)
from tests.chaos.schedule import KINDS, Fault, Leases

seeds = st.integers(min_value=0, max_value=2**32)
#: Seed 1000, 30 s, a fault every 5 s, as bench/chaos.py drew it for docs/reliability.md.
EXPECTED_1000 = ["t+2.5s cut node-3 for 7.5s", "t+7.2s kill scheduler for 1.3s",
                 "t+13.4s kill report for 2.0s", "t+18.9s nats_restart nats for 0.7s",
                 "t+24.3s cut node-1 for 6.9s", "t+29.9s nats_restart nats for 0.5s"]
kind_sets = st.sets(st.sampled_from(KINDS), min_size=1).map(sorted)


@given(seeds, st.floats(10, 300), st.floats(1, 20), kind_sets)
def test_a_seed_always_draws_the_same_schedule(seed: int, duration: float, every: float,
                                                kinds: list[schedule.Kind]) -> None:
    first = schedule.draw(seed, duration_s=duration, every_s=every, kinds=kinds)
    assert first == schedule.draw(seed, duration_s=duration, every_s=every, kinds=kinds)


@given(seeds, st.floats(10, 300), st.floats(1, 20), kind_sets, st.sampled_from([1, 3, 5]))
def test_a_schedule_is_spaced_in_time_and_hits_only_what_its_kind_can(
        seed: int, duration: float, every: float, kinds: list[schedule.Kind],
        servers: int) -> None:
    leases = Leases()
    faults = schedule.draw(seed, duration_s=duration, every_s=every, kinds=kinds,
                           nats_servers=servers)
    assert faults, "no fault drawn"
    nodes = schedule.node_names(3)
    members = schedule.nats_names(servers)
    assert len(members) == servers
    for fault in faults:
        assert 0 < fault.at_s < duration
        assert fault.target in schedule.targets_of(fault.kind, nodes, members)
        assert fault.kind in kinds or fault.kind == "kill"  # a node busy: a service kill
        if fault.kind in ("freeze", "cut"):
            assert fault.duration_s > leases.node_timeout_s  # a failure, not a stall
    for a, b in itertools.pairwise(faults):
        assert b.at_s - a.at_s >= every * 0.75 - 0.02
    outs = [f for f in faults if schedule.node_out(f)]
    for a, b in itertools.pairwise(outs):
        assert b.at_s >= a.at_s + a.duration_s + leases.node_timeout_s - 0.02, (a, b)


@given(seeds, kind_sets)
def test_a_schedule_depends_on_the_set_of_kinds_not_their_order(
        seed: int, kinds: list[schedule.Kind]) -> None:
    assert schedule.draw(seed, kinds=kinds) == schedule.draw(seed, kinds=kinds[::-1])


def test_the_documented_seeds_replay() -> None:
    """Seed 1000 of the published 100-schedule run (docs/reliability.md), drawn among the
    kinds there were then (new kinds go last in KINDS, so a subset without them draws as
    before): the same faults at the same times."""
    faults = schedule.draw(1000, duration_s=30, every_s=5,
                           kinds=schedule.KINDS[:schedule.KINDS.index("slow_disk")])
    assert [f.describe() for f in faults] == EXPECTED_1000


def test_different_seeds_draw_different_schedules() -> None:
    drawn = {schedule.draw(seed) for seed in range(20)}
    assert len(drawn) == 20


def marks(*rows: tuple[str, int, int, str, float, str]) -> list[Mark]:
    return [Mark(*row) for row in rows]


def evidence(steps: tuple[StepView, ...] = (), state: str = "succeeded",
             **fields: object) -> Evidence:
    ev = Evidence(seed=7, runs=[RunView(label="w0-x", run_id="r1", state=state,
                                        steps=steps)])
    for name, value in fields.items():
        setattr(ev, name, value)
    return ev


OK_STEP = StepView(name="s", state="succeeded", attempt=2,
                   history=(Attempt(1, "node-1", "lost"),))
CLEAN = marks(("start", 1, 10, "node-1", 1.0, "0"), ("tick", 1, 10, "node-1", 2.0, "5"),
              ("start", 2, 20, "node-2", 3.0, "4"), ("tick", 2, 20, "node-2", 4.0, "9"),
              ("end", 2, 20, "node-2", 4.1, ""))


def test_marker_lines_cut_short_by_a_kill_are_skipped() -> None:
    parsed = checks.parse_marks("start 1 10 node-1 1.000 0\ntick 1 10 no")
    assert parsed == [Mark("start", 1, 10, "node-1", 1.0, "0")]
    assert checks.parse_effects("2 20 4.000\n2 2") == [Effect(2, 20, 4.0)]


def test_a_clean_record_has_no_violation() -> None:
    ev = evidence((OK_STEP,), marks={"w0-x/s": CLEAN}, effects={"w0-x/s": [Effect(2, 20, 4.0)]},
                  events=[StoredEvent(seq=1, tag="task_started", run_id="r1", step="s",
                                      attempt=1),
                          StoredEvent(seq=2, tag="task_started", run_id="r1", step="s",
                                      attempt=2),
                          StoredEvent(seq=3, tag="run_state_changed", run_id="r1",
                                      state="succeeded")],
                  intervals={"w0-x/s": 1.0})
    outcome = checks.check_all(ev)
    assert outcome.violations == []
    assert outcome.lost == [checks.LostWork(key="w0-x/s", attempt=1, lost_s=0.0,
                                            bound_s=1.0 + checks.DURABLE_S)]


def test_a_run_that_did_not_succeed_is_a_violation() -> None:
    failed = StepView(name="s", state="failed", attempt=1, reason="exit 1")
    found = checks.check_final(evidence((failed,), state="failed"))
    assert len(found) == 1
    assert "seed 7" in found[0]
    assert "s failed" in found[0]
    assert "never ended" in checks.check_final(evidence((), state="running"))[0]


def test_two_attempts_running_at_once_are_found() -> None:
    overlapping = marks(("start", 1, 10, "node-1", 1.0, "0"), ("tick", 1, 10, "node-1", 5.0, "9"),
                        ("start", 2, 20, "node-2", 4.0, "3"))
    found = checks.check_overlaps(evidence((OK_STEP,), marks={"w0-x/s": overlapping}))
    assert len(found) == 1
    assert "ran at once" in found[0]


def test_one_attempt_started_twice_is_found() -> None:
    twice = marks(("start", 1, 10, "node-1", 1.0, "0"), ("start", 1, 11, "node-1", 1.5, "0"))
    found = checks.check_overlaps(evidence((OK_STEP,), marks={"w0-x/s": twice}))
    assert any("started by 2 processes" in f for f in found)


def test_effects_must_happen_once_and_never_from_a_superseded_attempt() -> None:
    double = {"w0-x/s": [Effect(2, 20, 4.0), Effect(2, 20, 4.0)]}
    assert "has 2 effects" in checks.check_effects(
        evidence((OK_STEP,), marks={"w0-x/s": CLEAN}, effects=double))[0][0]
    zombie = {"w0-x/s": [Effect(1, 10, 3.5), Effect(2, 20, 4.0)]}
    found, _ = checks.check_effects(evidence((OK_STEP,), marks={"w0-x/s": CLEAN},
                                             effects=zombie))
    assert len(found) == 1
    assert "after attempt 2 started" in found[0]
    redone = {"w0-x/s": [Effect(1, 10, 2.5), Effect(2, 20, 4.0)]}
    assert checks.check_effects(evidence((OK_STEP,), marks={"w0-x/s": CLEAN},
                                         effects=redone)) == ([], 1)


def test_a_stored_attempt_the_record_does_not_know_is_a_lost_message() -> None:
    unknown = [StoredEvent(seq=1, tag="task_exited", run_id="r1", step="s", attempt=3)]
    found = checks.check_events(evidence((OK_STEP,), events=unknown))
    assert any("attempt 3 is not in the run's record" in f for f in found)
    assert any("last stored run_state_changed" in f for f in found)
    ran = {"w0-x/s": [*CLEAN, Mark("start", 3, 30, "node-3", 5.0, "9")]}
    assert any("attempts [3] ran" in f for f in checks.check_events(
        evidence((OK_STEP,), marks=ran, events=[
            StoredEvent(seq=1, tag="run_state_changed", run_id="r1", state="succeeded")])))


def test_an_accepted_stale_checkpoint_is_a_violation() -> None:
    probes = [StaleProbe(label="w0-x", step="s", attempt=1, accepted=True, detail="ok")]
    assert "stale attempt 1 was accepted" in checks.check_stale_checkpoints(
        evidence((OK_STEP,), probes=probes))[0]
    late = [StoredEvent(seq=1, tag="task_started", run_id="r1", step="s", attempt=2),
            StoredEvent(seq=2, tag="checkpoint_committed", run_id="r1", step="s", attempt=1)]
    assert "after attempt 2 had started" in checks.check_stale_checkpoints(
        evidence((OK_STEP,), events=late))[0]


def test_a_training_result_unlike_the_fault_free_one_is_a_violation() -> None:
    ev = evidence((OK_STEP,), digests={"w0-x/s": "ab"}, reference_digest="cd")
    assert "differs from the fault-free" in checks.check_digests(ev)[0]
    ev.digests = {"w0-x/s": "cd"}
    assert checks.check_digests(ev) == []


def test_lost_work_is_bounded_by_the_interval_plus_any_store_outage() -> None:
    slow = marks(("start", 1, 10, "node-1", 0.0, "0"), ("tick", 1, 10, "node-1", 1.0, "10"),
                 ("tick", 1, 10, "node-1", 9.0, "90"), ("start", 2, 20, "node-2", 10.0, "10"))
    ev = evidence((OK_STEP,), marks={"w0-x/s": slow}, intervals={"w0-x/s": 1.0})
    losses, found = checks.lost_work(ev)
    assert losses[0].lost_s == 8.0
    assert len(found) == 1
    assert "lost 8.0 s" in found[0]
    outage = Fault(at_s=1.0, kind="kill", target="checkpoint-store", duration_s=6.0)
    ev.faults = [FaultRecord(fault=outage, started_at=2.0, healed_at=7.0, serving_at=8.0)]
    assert checks.lost_work(ev)[1] == []
    skipped = marks(("start", 1, 10, "node-1", 0.0, "0"), ("tick", 1, 10, "node-1", 1.0, "3"),
                    ("start", 2, 20, "node-2", 2.0, "9"))
    assert "resumed at 9" in checks.lost_work(
        evidence((OK_STEP,), marks={"w0-x/s": skipped}, intervals={"w0-x/s": 1.0}))[1][0]


def test_recovery_is_when_the_affected_work_runs_again() -> None:
    kill = Fault(at_s=1.0, kind="kill", target="node-1", duration_s=1.0)
    ev = evidence((OK_STEP,), marks={"w0-x/s": CLEAN},
                  faults=[FaultRecord(fault=kill, started_at=2.5, healed_at=3.5,
                                      serving_at=4.0)])
    assert checks.recovery_times(ev) == {"kill": [0.5]}
