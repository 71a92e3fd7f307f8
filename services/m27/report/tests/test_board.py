"""The dashboard's data (`m27.report.board`): GPU columns, the queue split, runs with their
links, event lines, and `?hours=` as used."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from m27.client import RunSummary
from m27.client.scheduler import QueueItem
from m27.common import events
from m27.report import board
from m27.report.store import GpuPoint


def test_each_gpu_becomes_columns_in_node_order() -> None:
    point = GpuPoint(at=60.0, utilization_pct=12.345, memory_used_mb=100, temperature_c=50.04,
                     power_w=None)
    series = board.gpu_series({("n2", 0): [point], ("n1", 1): [point, point]})
    assert [(s.node, s.gpu, len(s.t)) for s in series] == [("n1", 1, 2), ("n2", 0, 1)]
    assert (series[1].util, series[1].mem, series[1].temp) == ([12.3], [100], [50.0])


def _item(task: str, state: str, **kw: object) -> QueueItem:
    base: dict[str, object] = {
        "task_id": task, "run_id": "r", "step": task, "attempt": 1, "urgency": "normal",
        "user": "u", "gpus": 0.5, "cpus": 1, "state": state, "node_id": "", "queued_at": 1.0,
        "reason": "needs 0.50 GPU", "score": 1.0, "tier": "immediate"}
    base.update(kw)
    return QueueItem(**base)  # type: ignore[arg-type]


def test_the_queue_splits_into_waiting_in_order_and_placed() -> None:
    waiting, placed = board.tasks([_item("a", "waiting"), _item("b", "running", node_id="n1"),
                                   _item("c", "waiting"), _item("d", "paused", lender="b")])
    assert [t.task_id for t in waiting] == ["a", "c"]
    assert [(t.task_id, t.lender) for t in placed] == [("b", ""), ("d", "b")]


def test_runs_link_their_report_once_written() -> None:
    summary = RunSummary(run_id="r-1", name="n", user="u", state="failed", created_at=1.0,
                         ended_at=2.0, steps_total=3, steps_succeeded=1, steps_failed=1)
    [written] = board.runs([summary], reported={"r-1"})
    [later] = board.runs([summary], reported=set())
    assert (written.report, later.report) == ("reports/r-1.html", "")
    assert written.steps == "1/3 succeeded, 1 failed"
    assert written.compare == "compare/r-1"


def test_an_event_is_one_line_with_what_matters() -> None:
    event = events.TaskExited(at=5.0, task_id="r/s", run_id="r", step="s", attempt=2,
                              node_id="n1", exit_code=1,
                              cause="exit", reason="exit code 1")
    line = board.event_line("m27.events.task.r.s.node-n1", event)
    assert (line.at, line.kind) == (5.0, "task_exited")
    assert line.text == "r/s cause=exit exit_code=1 reason=exit code 1"


@given(st.one_of(st.none(), st.text(max_size=20),
                 st.floats(allow_nan=True).map(repr)))
def test_hours_asked_is_always_a_window_the_store_can_answer(text: str | None) -> None:
    hours = board.hours_asked(text)
    assert 0 < hours <= board.MAX_HOURS
    assert math.isfinite(hours)


def test_points_asked_is_bounded() -> None:
    assert [board.points_asked(t) for t in (None, "", "x", "5", "500", "99999")] == [
        board.POINTS_PER_GPU, board.POINTS_PER_GPU, board.POINTS_PER_GPU, 10, 500,
        board.MAX_POINTS_PER_GPU]
