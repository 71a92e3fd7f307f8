"""Events become notices whose ids name the happening: copies agree, happenings differ."""

from __future__ import annotations

import math

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from m27.common import events
from m27.common.model import GpuSample, RunRecord, StepRecord
from m27.common.notifications import CLUSTER_KINDS
from m27.common.platform import Platform
from m27.report import notices


def run(state: str = "failed") -> RunRecord:
    return RunRecord(run_id="r-1", name="md <sweep>", user="alice", urgency="normal",
                     state=state, created_at=1000.0,  # type: ignore[arg-type]
                     started_at=1010.0, ended_at=1010.0 + 7500, steps=(
                         StepRecord(name="train", type="gpu", command="x", state="failed"),),
                     reason="step train failed")


def ended(state: str = "failed", at: float = 8510.0) -> events.RunStateChanged:
    return events.RunStateChanged(at=at, run_id="r-1", state=state,  # type: ignore[arg-type]
                                  previous="running")


def test_a_run_end_says_what_ended_how_and_after_how_long() -> None:
    notice = notices.run_ended(ended(), run(), metrics={"loss": 0.25, "acc": math.nan})
    assert notice is not None
    assert notice.kind == "run_failed"
    assert notice.user == "alice"
    assert notice.state == "failed"
    first, *rest = notice.text.splitlines()
    assert first == "❌ run r-1 (md <sweep>) failed after 2 h 05 min"
    assert rest == ["failed: train", "step train failed", "loss 0.25 · acc nan"]
    assert notice.duration_s == 7500


def test_only_ends_are_notices() -> None:
    assert notices.run_ended(ended(state="running"), run()) is None


def test_copies_of_an_event_are_one_notice_and_a_later_end_is_another() -> None:
    a = notices.run_ended(ended(), run())
    b = notices.run_ended(ended(), run(), metrics={"loss": 1.0})  # metrics came in later
    c = notices.run_ended(ended(at=9999.0), run())  # retried and failed again
    assert a is not None
    assert b is not None
    assert c is not None
    assert a.id == b.id != c.id


def anomaly(**change: object) -> events.TrainingAnomaly:
    fields: dict[str, object] = {
        "at": 1.0, "task_id": "r-1/train", "run_id": "r-1", "step": "train", "attempt": 1,
        "node_id": "n1", "kind": "spike", "metric": "loss", "train_step": 120, "value": 9.5,
        "baseline": 0.4, "actions": ("checkpoint", "notify")}
    fields.update(change)
    return events.TrainingAnomaly(**fields)  # type: ignore[arg-type]


def test_an_anomaly_names_the_metric_step_value_and_baseline() -> None:
    notice = notices.anomaly(anomaly(), "alice")
    assert notice.text == ("⚠ spike in loss of r-1/train at step 120: 9.5 (baseline 0.4); "
                           "checkpoint, notify")
    assert notices.anomaly(anomaly(value="NaN", baseline=None), "alice").text.startswith(
        "⚠ spike in loss of r-1/train at step 120: NaN;")
    assert notices.anomaly(anomaly(at=5.0), "alice").id == notice.id
    assert notices.anomaly(anomaly(attempt=2), "alice").id != notice.id


def test_a_task_is_waiting_once_per_time_it_was_queued() -> None:
    assert notices.waiting("r-1/train", "r-1", "alice", 0.0, 3599.0, 3600.0) is None
    late = notices.waiting("r-1/train", "r-1", "alice", 0.0, 3700.0, 3600.0, "no GPU free")
    later = notices.waiting("r-1/train", "r-1", "alice", 0.0, 9000.0, 3600.0)
    again = notices.waiting("r-1/train", "r-1", "alice", 5000.0, 9000.0, 3600.0)
    assert late is not None
    assert later is not None
    assert again is not None
    assert late.text == "⏳ r-1/train has waited 1 h 01 min for a GPU: no GPU free"
    assert late.id == later.id != again.id
    assert notices.waiting("r-1/train", "r-1", "alice", 0.0, 1e9, 0.0) is None  # off


def reading(at: float, *temps: float) -> events.GpuTelemetry:
    return events.GpuTelemetry(at=at, node_id="n1", incarnation="i", seq=1, backend="simulated",
                               gpus=tuple(GpuSample(index=i, utilization_pct=50.0,
                                                    memory_used_mb=0, temperature_c=t,
                                                    simulated=True)
                                          for i, t in enumerate(temps)))


def test_a_hot_gpu_is_told_once_an_hour_and_a_simulated_one_says_so() -> None:
    hot = notices.hot_gpus(reading(7200.0, 60.0, 91.0, math.nan), 85.0)
    assert [n.node_id for n in hot] == ["n1"]
    assert hot[0].text == "🔥 GPU 1 on n1 at 91 °C (limit 85 °C) [simulated GPU]"
    same_hour = notices.hot_gpus(reading(7200.0 + 3599, 60.0, 95.0), 85.0)
    next_hour = notices.hot_gpus(reading(7200.0 + 3600, 60.0, 95.0), 85.0)
    assert same_hour[0].id == hot[0].id != next_hour[0].id


@given(st.floats(min_value=0, max_value=1e9))
def test_durations_read_as_a_person_would_say_them(seconds: float) -> None:
    text = notices.human_duration(seconds)
    assert text.split()[-1] in {"s", "min", "h"}
    assert len(text) <= 20


def test_a_node_whose_driver_differs_is_told_and_so_is_its_return_to_agreement() -> None:
    differs = events.NodePlatformDiffers(
        at=10.0, node_id="n3", platform=Platform(driver="535.104.05"),
        differences=("driver 535.104.05, most nodes 550.54.15 (2 of 3)",))
    notice = notices.node_platform(differs)
    assert (notice.kind, notice.node_id, notice.state) == ("node_platform", "n3", "differs")
    assert "driver 535.104.05, most nodes 550.54.15" in notice.text
    agrees = notices.node_platform(msgspec.structs.replace(differs, at=20.0, differences=()))
    assert agrees.state == "agrees"
    assert "agree with most nodes again" in agrees.text
    assert agrees.id != notice.id
    assert "node_platform" in CLUSTER_KINDS


def test_a_maintenance_windows_outcome_is_told_with_the_commands_output() -> None:
    base = events.NodeMaintenanceWindow(at=20.0, node_id="n2", phase="draining",
                                        occurrence=1_796_612_400.0, command="reset")
    assert notices.maintenance_window(base) is None
    done = notices.maintenance_window(msgspec.structs.replace(base, phase="succeeded"))
    assert done is not None
    assert (done.kind, done.state) == ("node_maintenance", "succeeded")
    assert "takes work again" in done.text
    failed = notices.maintenance_window(msgspec.structs.replace(
        base, phase="failed", detail="the command exited with 7", output_tail="busy\n"))
    assert failed is not None
    assert "FAILED: the command exited with 7; output: busy" in failed.text
    assert "m27 node uncordon n2" in failed.text
    assert failed.id != done.id
    assert "node_maintenance" in CLUSTER_KINDS
