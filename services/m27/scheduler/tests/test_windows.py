"""Driving a maintenance window through its phases (pure): drain at its start, the command
once the node is empty, uncordon on success, cordoned on failure, then the next one."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st

from m27.common.windows import Window
from m27.scheduler._windows import (
    ANSWER_MARGIN_S,
    DRAIN_LIMIT_S,
    WindowRecord,
    advance,
    finished,
    scheduled,
    window_in_s,
)

DAY = 86400.0
MIDNIGHT = dt.datetime(2026, 12, 7, tzinfo=dt.UTC).timestamp()
THREE = MIDNIGHT + 3 * 3600


def daily(lead_s: float = 7200.0, timeout_s: float = 600.0) -> WindowRecord:
    record = scheduled(Window(node_id="n1", at="03:00", every="day", lead_s=lead_s,
                              timeout_s=timeout_s, command="nvidia-smi --gpu-reset"), MIDNIGHT)
    assert record is not None
    return record


def test_a_window_drains_at_its_start_runs_when_empty_and_uncordons_on_success() -> None:
    record = daily()
    assert record.next_at == THREE
    assert advance(record, THREE - 1, tasks_on_node=2).effects == ()
    step = advance(record, THREE, tasks_on_node=2)
    assert step.effects == ("drain",)
    assert step.record is not None
    draining = step.record
    assert (draining.phase, draining.occurrence) == ("draining", THREE)
    assert advance(draining, THREE + 30, tasks_on_node=1).effects == ()
    running = advance(draining, THREE + 60, tasks_on_node=0)
    assert running.effects == ("run",)
    assert running.record is not None
    done = finished(running.record, THREE + 90, occurrence=THREE, exit_code=0, error="")
    assert done is not None
    assert done.effects == ("uncordon", "report_succeeded")
    assert done.record is not None
    assert (done.record.phase, done.record.next_at, done.record.runs) == (
        "scheduled", THREE + DAY, 1)
    assert done.record.last == "succeeded"
    # a late or repeated answer changes nothing
    assert finished(done.record, THREE + 95, occurrence=THREE, exit_code=0, error="") is None


def test_a_failed_command_leaves_the_node_cordoned_and_moves_to_the_next_occurrence() -> None:
    running = WindowRecord(window=daily().window, next_at=THREE, phase="running",
                           occurrence=THREE, phase_since=THREE + 10)
    done = finished(running, THREE + 20, occurrence=THREE, exit_code=3, error="")
    assert done is not None
    assert done.effects == ("report_failed",)  # no uncordon
    assert done.detail == "the command exited with 3"
    assert done.record is not None
    assert done.record.next_at == THREE + DAY
    assert done.record.last.startswith("failed")


def test_no_answer_and_a_node_that_does_not_empty_are_failures_in_time() -> None:
    window = daily(timeout_s=600.0).window
    running = WindowRecord(window=window, next_at=THREE, phase="running", occurrence=THREE,
                           phase_since=THREE)
    assert advance(running, THREE + 600 + ANSWER_MARGIN_S, tasks_on_node=0).effects == ()
    late = advance(running, THREE + 601 + ANSWER_MARGIN_S, tasks_on_node=0)
    assert late.effects == ("report_failed",)
    assert "no answer" in late.detail
    draining = WindowRecord(window=window, next_at=THREE, phase="draining",
                            occurrence=THREE, phase_since=THREE)
    stuck = advance(draining, THREE + DRAIN_LIMIT_S + 1, tasks_on_node=1)
    assert stuck.effects == ("report_failed",)
    assert "1 task(s) still on the node" in stuck.detail


def test_a_once_window_is_removed_after_it_ran() -> None:
    once = scheduled(Window(node_id="n1", at="03:00", first_day="2026-12-07"), MIDNIGHT)
    assert once is not None
    step = advance(once, THREE, tasks_on_node=0)
    assert step.record is not None
    step = advance(step.record, THREE + 1, tasks_on_node=0)
    assert step.record is not None
    done = finished(step.record, THREE + 2, occurrence=THREE, exit_code=0, error="")
    assert done is not None
    assert done.record is None
    assert done.effects == ("uncordon", "report_succeeded")


def test_the_placement_rule_applies_within_the_lead_and_while_it_runs() -> None:
    record = daily(lead_s=3600.0)
    assert window_in_s(record, THREE - 3601) is None
    assert window_in_s(record, THREE - 1800) == 1800.0
    draining = advance(record, THREE, tasks_on_node=1).record
    assert draining is not None
    assert window_in_s(draining, THREE + 5) == 0.0


@given(st.lists(st.tuples(st.floats(0, 4 * DAY), st.integers(0, 3),
                          st.sampled_from([None, 0, 1])), max_size=40))
def test_the_command_is_only_ever_sent_to_an_empty_node_and_once_per_occurrence(
        events: list[tuple[float, int, int | None]]) -> None:
    record: WindowRecord | None = daily()
    now = MIDNIGHT
    sent: list[float] = []
    for later, tasks, answer in events:
        if record is None:
            break
        now += later
        step = advance(record, now, tasks_on_node=tasks)
        if "run" in step.effects:
            assert tasks == 0
            assert record.occurrence not in sent
            sent.append(record.occurrence)
        record = step.record
        if record is not None and record.phase == "running" and answer is not None:
            done = finished(record, now, occurrence=record.occurrence, exit_code=answer,
                            error="")
            assert done is not None
            assert ("uncordon" in done.effects) == (answer == 0)
            record = done.record
    assert len(sent) == len(set(sent))
