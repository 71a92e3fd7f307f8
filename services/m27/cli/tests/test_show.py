"""`m27 show`: what one run's steps went through, attempts and preemptions included."""

from __future__ import annotations

from m27.cli._runs import show_lines
from m27.common.model import AttemptRecord, RunRecord, StepRecord


def test_a_preempted_step_shows_its_attempts_and_how_often_it_was_preempted() -> None:
    first = AttemptRecord(attempt=1, node_id="n1", started_at=10.0, ended_at=20.0,
                          exit_code=143, cause="preempted",
                          reason="killed by SIGTERM: preempted: make room for r/fix")
    step = StepRecord(name="sweep", type="gpu", command="x", state="running", attempt=2,
                      node_id="n1", started_at=30.0, preemptions=1, history=(first,))
    run = RunRecord(run_id="r-20261201-000000-abcdef", name="p", user="u", urgency="low",
                    state="running", created_at=1.0, steps=(step,))
    lines = show_lines(run)
    assert "attempt 2 (1 preempted)" in lines[2]
    assert lines[-1].strip() == ("attempt 1 on n1: killed by SIGTERM: preempted: make room "
                                 "for r/fix (preempted)")
