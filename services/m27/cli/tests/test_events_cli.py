"""`m27 events`' lines: every event type becomes one clean line; --json keeps the event."""

from __future__ import annotations

import json
import re
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m27.cli._events import event_line, json_line
from m27.client import BusEvent
from m27.common import events as ev

RUN = "r-20261201-081500-a1b2c3"
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def item(event: ev.Event, subject: str = f"m27.events.run.{RUN}.state",
         sequence: int = 7) -> BusEvent:
    return BusEvent(event=event, event_json=ev.encode(event).decode(), subject=subject,
                    sequence=sequence, stored_at=event.at)


def rest(line: str) -> str:
    """A line without its local-time stamp (the first two words)."""
    return line.split("  ", 1)[1]


@pytest.mark.parametrize("kind", get_args(ev.Event), ids=lambda kind: kind.__name__)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_any_event_of_each_type_is_one_clean_line(kind: type[ev.Event],
                                                  data: st.DataObject) -> None:
    """Whatever an event holds (control characters, NaN, huge numbers), its line is one
    line without control characters, and --json keeps it with its subject and seq."""
    event = data.draw(st.from_type(kind))
    line = event_line(item(event))
    assert "\n" not in line
    assert not CONTROL.search(line)
    assert ev.tag_of(event) in line
    decoded = json.loads(json_line(item(event)))
    assert (decoded["type"], decoded["seq"]) == (ev.tag_of(event), 7)
    assert decoded["subject"] == f"m27.events.run.{RUN}.state"


def test_lines_show_what_happened_where() -> None:
    cases: list[tuple[ev.Event, str]] = [
        (ev.RunSubmitted(at=1.0, run_id=RUN, name="study", user="ada", urgency="high",
                         steps=("prep", "train")),
         f"{RUN}  study by ada: 2 steps, urgency high"),
        (ev.StepStateChanged(at=1.0, run_id=RUN, step="train", state="failed",
                             previous="running", attempt=2, node_id="node-1", exit_code=7,
                             reason="exit 7\nno input file"),
         f"{RUN}/train  running → failed (attempt 2, on node-1, exit 7): exit 7 no input file"),
        (ev.RunStateChanged(at=1.0, run_id=RUN, state="succeeded", previous="running"),
         f"{RUN}  running → succeeded"),
        (ev.TaskExited(at=1.0, task_id=f"{RUN}/train", run_id=RUN, step="train", attempt=1,
                       node_id="node-2", exit_code=None, cause="lost"),
         f"{RUN}/train  exit unknown on node-2 (attempt 1, cause lost)"),
        (ev.TrainingAnomaly(at=1.0, task_id=f"{RUN}/train", run_id=RUN, step="train",
                            attempt=1, node_id="node-1", kind="nan", metric="loss",
                            train_step=1200, value="NaN", actions=("checkpoint", "stop")),
         f"{RUN}/train  nan in loss = NaN at step 1200 on node-1 (attempt 1, → checkpoint, "
         "stop)"),
        (ev.NodeLost(at=1.0, node_id="node-3", last_heartbeat=0.0),
         "node-3  lost: last heartbeat at —"),
        (ev.GpuMemoryLeak(at=1.0, node_id="node-1", gpu_index=0, task_id=f"{RUN}/a",
                          pids=(41, 42), memory_mb=512, cleaned=True),
         f"node-1  GPU 0: 512 MiB still held after {RUN}/a by pid 41,42, cleaned"),
    ]
    for event, expected in cases:
        line = rest(event_line(item(event)))
        assert line.split(None, 1) == [ev.tag_of(event), expected], line


def test_a_type_this_client_does_not_know_is_still_a_line() -> None:
    unknown = BusEvent(event=None, event_json='{"type":"quantum_leap","at":5,"x":1}',
                       subject="m27.events.node.n1", sequence=3, stored_at=5.0)
    assert rest(event_line(unknown)).startswith("quantum_leap")
    assert "m27.events.node.n1" in event_line(unknown)
    assert json.loads(json_line(unknown)) == {"type": "quantum_leap", "at": 5, "x": 1,
                                               "subject": "m27.events.node.n1", "seq": 3}
