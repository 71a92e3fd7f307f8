"""Units, identifiers and the wire format of events."""

from __future__ import annotations

import json

import msgspec
import pytest

from m27.common import events, proto
from m27.common.ids import is_valid_name, is_valid_run_id, new_run_id, split_task_id, task_id
from m27.common.model import AttemptRecord, Resources, RunRecord, StepRecord
from m27.common.units import format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(("text", "seconds"), [
    ("300s", 300.0), ("5m", 300.0), ("1h", 3600.0), ("50ms", 0.05), ("2", 2.0),
    (" 1.5 m ", 90.0), ("1d", 86400.0), (7, 7.0),
])
def test_parse_duration(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5 minutes", "-1s", "1w", "abc", "nan", "\u0665m",
                                  10**400, -(10**400), "1" * 400])
def test_parse_duration_rejects(text: str | int) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(("text", "size"), [
    ("128KB", 131072), ("128KiB", 131072), ("8GiB", 8 << 30), ("1MB", 1 << 20), ("512", 512),
    ("1.5K", 1536),
])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "big", "1XB", "-5", "8i", "8ib", "\u0665MB", "1KiBB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_formatting() -> None:
    assert format_duration(0.25) == "250ms"
    assert format_duration(42) == "42s"
    assert format_duration(185) == "3m05s"
    assert format_duration(7800) == "2h10m"
    assert format_size(512) == "512B"
    assert format_size(3 << 30) == "3.0GiB"


def test_ids() -> None:
    run_id = new_run_id(0.0, "a1b2c3")
    assert run_id == "r-19700101-000000-a1b2c3"
    assert is_valid_run_id(run_id)
    assert split_task_id(task_id(run_id, "train")) == (run_id, "train")
    for bad in ("x/train", f"{run_id}/../x", f"{run_id}", "../../etc/passwd"):
        with pytest.raises(ValueError, match="task id"):
            split_task_id(bad)
    assert is_valid_name("md_simulation-2")
    with pytest.raises(ValueError, match="task id"):
        split_task_id(task_id(run_id, "train") + "\n")
    assert not is_valid_run_id(run_id.replace("0", "\u0660"))
    for bad in ("", "a.b", "a b", "*", ">", "-x", "x" * 101, "a/b", "train\n"):
        assert not is_valid_name(bad)


def test_events_are_plain_json_with_a_type_tag() -> None:
    event = events.StepStateChanged(at=1.5, run_id="r", step="train", state="running",
                                    previous="queued", attempt=1, node_id="n1")
    data = json.loads(events.encode(event))
    assert data["type"] == "step_state_changed"
    assert data["state"] == "running"
    assert events.decode_event(events.encode(event)) == event


def test_commands_round_trip_and_are_kept_apart_from_events() -> None:
    command = events.StartTask(at=1.0, task_id="r/s", run_id="r", step="s", attempt=2,
                               step_type="gpu", command="echo", gpu_ids=(0,), gpu_share=1.0)
    assert events.decode_node_command(events.encode(command)) == command
    with pytest.raises(msgspec.ValidationError):
        events.decode_event(events.encode(command))
    with pytest.raises(msgspec.ValidationError):
        events.decode_scheduler_command(events.encode(command))


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    data = json.dumps({"type": "node_stopped", "at": 1.0, "node_id": "n", "added_later": 5})
    assert events.decode_event(data.encode()) == events.NodeStopped(at=1.0, node_id="n")


def test_run_survives_the_trip_through_protobuf() -> None:
    run = RunRecord(run_id="r-20261201-000000-abcdef", name="p", user="u", urgency="urgent",
                    state="failed", created_at=1.0, started_at=2.0, ended_at=3.0,
                    workdir="/w", report_path="/r.html", reason="failed step(s): a",
                    steps=(StepRecord(name="a", type="gpu_light", command="x",
                                      depends_on=("b",), state="failed", attempt=1,
                                      node_id="n1", gpu_ids=(1,), gpu_share=0.5,
                                      gpu_simulated=True, exit_code=0, stderr_tail="e",
                                      stdout_tail="o", queued_at=1.5, started_at=2.0,
                                      ended_at=3.0, reason="why", outputs=("/o", "/p"),
                                      inputs=("/i",), group="a", matrix={"lr": "0.1"},
                                      failures=1, preemptions=2, urgency="high",
                                      preemptible=True,
                                      timeout_s=60.0, workdir="sub", cached_from="r/x",
                                      history=(AttemptRecord(attempt=1, node_id="n",
                                                             started_at=1.0, ended_at=2.0,
                                                             exit_code=None, cause="lost",
                                                             reason="node lost"),),
                                      resources=Resources(gpus=0.5, cpus=2,
                                                          gpu_memory_mb=100, memory_mb=5)),
                           StepRecord(name="b", type="cpu", command="y")))
    back = proto.run_from_proto(proto.run_to_proto(run))
    assert back == msgspec.structs.replace(run, vars={})


def test_a_steps_checkpoint_interval_crosses_grpc() -> None:
    every = StepRecord(name="md", type="gpu", command="x", checkpoint_interval_s=300.0)
    assert proto.step_from_proto(proto.step_to_proto(every)).checkpoint_interval_s == 300.0
    never = StepRecord(name="md", type="gpu", command="x")
    assert proto.step_from_proto(proto.step_to_proto(never)).checkpoint_interval_s is None
