"""The progress view of `m27 watch`: events folded into the run, lines rendered from it."""

from __future__ import annotations

import io

from m27.cli._live import LiveView, lines, progress
from m27.cli._watch import (
    apply_event,
    exit_code_for,
    render_event_line,
    render_frame,
    render_table,
)
from m27.cli.tests.terminal import screen
from m27.client import RunEvent
from m27.common.model import RunRecord, StepRecord

RUN = "r-20261201-000000-abcdef"


def a_run() -> RunRecord:
    return RunRecord(run_id=RUN, name="study", user="ada", urgency="normal", state="queued",
                     created_at=100.0, steps=(StepRecord(name="prep", type="cpu", command="x"),
                                              StepRecord(name="train", type="gpu", command="y",
                                                         depends_on=("prep",))))


def step_event(step: str, previous: str, state: str, at: float, **extra: object) -> RunEvent:
    return RunEvent(type="step_state_changed", at=at, run_id=RUN, step=step,
                    previous=previous, state=state, **extra)  # type: ignore[arg-type]


def test_events_move_steps_and_the_run_forward() -> None:
    run = a_run()
    run = apply_event(run, step_event("prep", "queued", "running", 101.0, node_id="node-1",
                                      attempt=1))
    run = apply_event(run, RunEvent(type="run_state_changed", at=101.0, run_id=RUN,
                                    state="running", previous="queued"))
    run = apply_event(run, step_event("prep", "running", "failed", 103.5, exit_code=2))
    prep = run.step("prep")
    assert prep is not None
    assert (prep.state, prep.node_id, prep.started_at, prep.ended_at, prep.exit_code) == \
        ("failed", "node-1", 101.0, 103.5, 2)
    assert run.state == "running"
    assert run.started_at == 101.0


def test_the_table_shows_each_step_with_its_state_time_and_exit_code() -> None:
    run = apply_event(a_run(), step_event("prep", "queued", "running", 101.0,
                                          node_id="node-1"))
    run = apply_event(run, step_event("prep", "running", "failed", 104.0, exit_code=2))
    lines = render_table(run, now=110.0)
    assert lines[0].startswith(f"run {RUN}  study  queued  0/2 steps done")
    assert lines[1] == "  ✘ prep   failed        3.0s  node-1  exit 2"
    assert lines[2] == "  · train  pending"


def test_event_lines_for_logs() -> None:
    line = render_event_line(step_event("train", "queued", "running", 0.0, node_id="n2"))
    assert line is not None
    assert line.endswith("step train: queued → running on n2")
    failed = render_event_line(step_event("train", "running", "failed", 0.0, exit_code=3,
                                          reason="exit code 3"))
    assert failed is not None
    assert failed.endswith("running → failed (exit 3): exit code 3")
    assert render_event_line(RunEvent(type="report_ready", at=0.0, run_id=RUN)) is None


def test_a_live_view_redraws_in_place_and_leaves_no_stale_rows() -> None:
    out = io.StringIO()
    with LiveView(out, live=True, width=40) as view:
        view.draw(lines(["first frame", "a second row", "and a third"]))
        view.draw(lines(["x" * 100, "short"]))  # wider than the terminal, and shorter
    assert screen(out.getvalue(), 40) == ["x" * 39 + "…", "short"]


def test_a_frame_taller_than_the_terminal_is_cut_and_leaves_nothing_behind() -> None:
    out = io.StringIO()
    with LiveView(out, live=True, width=40, height=6) as view:
        view.draw(lines([f"row {i}" for i in range(30)]))  # a sweep of 30 steps
        tall = screen(out.getvalue(), 40)
        view.draw(lines(["only", "two"]))
    assert len(tall) <= 6  # cut to the terminal's height, so a redraw can erase it all
    assert screen(out.getvalue(), 40) == ["only", "two"]


def test_the_step_table_on_a_terminal_fits_its_width() -> None:
    run = apply_event(a_run(), step_event("prep", "queued", "running", 101.0,
                                          node_id="node-with-a-very-long-name-" * 3))
    out = io.StringIO()
    with LiveView(out, live=True, width=50) as view:
        view.draw(render_frame(run, now=110.0))
    rows = screen(out.getvalue(), 50)
    assert rows[0].startswith(f"run {RUN}")
    assert rows[2].split()[:4] == ["▶", "prep", "running", "9.0s"]
    assert rows[2].endswith("…")  # the node's long name gave up the width, nothing else
    assert rows[3].split() == ["·", "train", "pending"]


def test_off_a_terminal_nothing_is_redrawn_and_no_escape_code_is_written() -> None:
    out = io.StringIO()
    with LiveView(out) as view:  # a StringIO is not a terminal
        view.draw(lines(["a frame"]))
    assert not view.live
    assert out.getvalue() == ""


def test_exit_codes() -> None:
    from msgspec.structs import replace

    assert exit_code_for(replace(a_run(), state="succeeded")) == 0
    assert exit_code_for(replace(a_run(), state="failed")) == 1
    assert exit_code_for(replace(a_run(), state="cancelled")) == 3
    assert exit_code_for(a_run()) == 4


def test_the_outcome_of_a_failed_run_shows_each_failed_steps_stderr_and_where_to_look() -> None:
    from msgspec.structs import replace

    from m27.cli._watch import outcome_lines

    run = a_run()
    failed = replace(run.steps[1], state="failed", exit_code=2, node_id="node-1", attempt=3,
                     reason="exit code 2",
                     stderr_tail="\n".join(f"line {i}" for i in range(15)) + "\n")
    run = replace(run, state="failed", steps=(replace(run.steps[0], state="succeeded"),
                                              failed))
    lines = outcome_lines(run, "/r/report.html")
    assert lines[0] == "step train failed (exit 2 on node-1, attempt 3): exit code 2"
    assert lines[1] == "  its stderr ends with:"
    assert lines[2:12] == [f"    line {i}" for i in range(5, 15)]  # the last 10 lines
    assert lines[12] == (f"  all of its output: m27 logs {RUN} train; every attempt: "
                         f"m27 show {RUN}")
    assert lines[13] == "run failed; report: /r/report.html"
    assert outcome_lines(replace(run, state="succeeded", steps=run.steps[:1])) == [
        "run succeeded"]


def test_progress_bars_draw_on_a_terminal_and_nothing_elsewhere() -> None:
    shown, hidden = io.StringIO(), io.StringIO()
    for out, terminal in ((shown, True), (hidden, None)):
        with progress(out, terminal=terminal, data=True) as bars:
            bar = bars.add_task("restoring c-1", total=4 * 1024**2)
            bars.advance(bar, 4 * 1024**2)
    rows = screen(shown.getvalue(), 80)
    assert rows[-1].startswith("restoring c-1")
    assert "100%" in rows[-1]
    assert "4.2 MB" in rows[-1]
    assert hidden.getvalue() == ""  # a pipe or a log file gets no frames
