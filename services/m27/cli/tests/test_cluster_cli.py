"""`m27 nodes`, `m27 top` and `m27 logs`: the lines they render and where output goes."""

from __future__ import annotations

import io

import pytest

from m27.cli import build_parser
from m27.cli._cluster import (
    backend_label,
    destination,
    gpu_line,
    render_nodes,
    top_frame,
)
from m27.cli._live import LiveView, lines
from m27.cli.tests.terminal import screen
from m27.client import GpuStatus, LogChunk, NodeStatus, TaskShare

RUN = "r-20261201-000000-abcdef"


def gpu(index: int, **changes: object) -> GpuStatus:
    fields: dict[str, object] = {
        "index": index, "name": "m27 simulated GPU", "uuid": f"SIM-{index}",
        "simulated": True, "memory_total_mb": 16384, "memory_used_mb": 0,
        "utilization_pct": 0.0, "temperature_c": 30.0,
    }
    fields.update(changes)
    return GpuStatus(**fields)  # type: ignore[arg-type]


BUSY = gpu(0, memory_used_mb=4096, utilization_pct=37.4, temperature_c=51.0, power_w=120.0,
           power_limit_w=300.0, throttle=("thermal",),
           holdings=(TaskShare(task_id=f"{RUN}/train", attempt=1, share=0.5),
                     TaskShare(task_id=f"{RUN}/eval", attempt=2, share=0.3, paused=True)))
NODE = NodeStatus(node_id="node-1", hostname="h", backend="simulated", state="up",
                  heartbeat_age_s=0.4, cpu_slots=16, cpu_used=1, gpus=(BUSY, gpu(1)),
                  cgroups=True)
LOST = NodeStatus(node_id="gpu-box-02", hostname="g", backend="nvml", state="lost",
                  heartbeat_age_s=42.0, cpu_slots=64, cpu_used=0)


def test_nodes_show_state_backend_heartbeat_cpu_and_every_gpu() -> None:
    assert render_nodes([NODE, LOST]) == [
        "NODE        STATE     BACKEND                     HEARTBEAT    CPU",
        "node-1      up        simulated (not real GPUs)   400ms ago    1/16     cgroups",
        "    GPUs: 2 x m27 simulated GPU",
        "    GPU     UTIL  MEMORY             TEMP  POWER       THROTTLE  TASKS",
        f"    0 sim    37%  4.0/16.0 GiB       51°C  120/300 W   thermal   {RUN}/train#1 ×0.5, "
        f"{RUN}/eval#2 ×0.3 paused",
        "    1 sim     0%  0.0/16.0 GiB       30°C  —           —         —",
        "gpu-box-02  LOST      nvml                        42s ago      0/64",
    ]


def test_nodes_show_gpu_models_and_versions_and_say_what_differs() -> None:
    real = NodeStatus(node_id="n3", hostname="h", backend="nvml", state="up",
                      heartbeat_age_s=1.0, cpu_slots=8, cpu_used=0,
                      gpus=(gpu(0, name="NVIDIA A10G", simulated=False),) * 2,
                      driver_version="535.104.05", cuda_version="12.2",
                      platform_differences=("driver 535.104.05, most nodes 550.54.15 (2 of 3)",))
    assert render_nodes([real])[2] == (
        "    GPUs: 2 x NVIDIA A10G; driver 535.104.05, CUDA 12.2, NVML unknown  DIFFERS: "
        "driver 535.104.05, most nodes 550.54.15 (2 of 3)")


def test_simulated_gpus_are_labelled_as_such() -> None:
    assert "not real" in backend_label("simulated")
    assert backend_label("nvml") == "nvml"
    real = gpu(3, simulated=False, power_w=250.0)
    assert gpu_line(real).startswith("    3         0%")
    assert "250 W" in gpu_line(real)


def test_no_nodes_says_how_to_get_one() -> None:
    assert render_nodes([]) == ["no nodes registered: start a node-agent (`m27 up` starts "
                                "one)"]


def test_a_top_frame_sums_up_the_cluster_above_the_table() -> None:
    frame = top_frame([NODE, LOST], now=0.0, interval_s=2.0)
    assert frame[0].startswith("m27 top  ")
    assert frame[0].endswith("nodes 1/2 up  GPUs 1/2 busy  (every 2s, Ctrl-C quits)")
    assert frame[1] == ""
    assert frame[2:] == render_nodes([NODE, LOST])


def test_top_frames_redrawn_live_fit_the_terminal_and_leave_no_stale_rows() -> None:
    out = io.StringIO()
    with LiveView(out, live=True, width=41) as view:
        view.draw(lines(top_frame([NODE, LOST], now=0.0, interval_s=2.0)))
        view.draw(lines(["z" * 200]))  # one wide row after a longer frame
    assert screen(out.getvalue(), 41) == ["z" * 40 + "…"]


@pytest.mark.parametrize(("stream", "asked", "goes_to"), [
    ("stdout", "both", "stdout"), ("stderr", "both", "stderr"),
    ("stderr", "stderr", "stdout"), ("stdout", "stdout", "stdout"),
])
def test_stderr_goes_to_stderr_only_when_both_are_shown(stream: str, asked: str,
                                                        goes_to: str) -> None:
    chunk = LogChunk(stream=stream, data=b"x", offset=0)  # type: ignore[arg-type]
    assert destination(chunk, asked) == goes_to


def test_logs_options() -> None:
    args = build_parser().parse_args(["logs", RUN, "train", "-f", "--stderr", "--tail",
                                      "64KiB", "--attempt", "2"])
    assert (args.run_id, args.step, args.follow, args.stderr, args.stdout, args.tail,
            args.attempt) == (RUN, "train", True, True, False, "64KiB", 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["logs", RUN, "train", "--stderr", "--stdout"])


def test_top_and_nodes_options() -> None:
    top = build_parser().parse_args(["top", "--interval", "500ms", "--once"])
    assert (top.interval, top.once) == ("500ms", True)
    assert build_parser().parse_args(["nodes", "--json"]).json


def test_status_names_windows_under_way_near_or_failed() -> None:
    from m27.cli._windows import render_window, status_notes
    from m27.client.scheduler import WindowStatus

    base = WindowStatus(node_id="gpu-02", at="03:00", tz="UTC", every="day", first_day="",
                        command="nvidia-smi --gpu-reset", lead_s=7200.0, timeout_s=600.0,
                        next_at=10_000.0, phase="scheduled", occurrence=0.0, runs=2,
                        last="failed: the command exited with 3", created_by="alice")
    assert status_notes([base], 0.0) == [
        "  node gpu-02: its last maintenance window failed: the command exited with 3"]
    near = status_notes([base], 9_000.0)
    assert near[0].startswith("  node gpu-02: maintenance window in 16m")
    running = WindowStatus(**{**{f: getattr(base, f) for f in base.__struct_fields__},
                              "phase": "draining", "last": ""})
    assert status_notes([running], 0.0) == ["  node gpu-02: maintenance window draining"]
    line = render_window(base, 0.0)
    assert line.startswith("gpu-02: every day at 03:00 UTC; next ")
    assert "command: nvidia-smi --gpu-reset; lead 2h00m, limit 10m00s" in line
    assert line.endswith("last: failed: the command exited with 3; 2 run(s)")


def test_in_a_duration_is_the_next_whole_second_in_the_zone() -> None:
    from m27.cli._windows import starting_in
    from m27.common.errors import M27Error
    midnight_utc = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
    assert starting_in(90.2, "UTC", midnight_utc) == ("00:01:31", "2026-01-01")
    assert starting_in(0, "Asia/Tokyo", midnight_utc - 1) == ("08:59:59", "2026-01-01")
    assert starting_in(3600, "America/New_York", midnight_utc) == ("20:00:00", "2025-12-31")
    for seconds, zone in ((-1.0, "UTC"), (float("nan"), "UTC"), (400 * 86400.0, "UTC"),
                          (60.0, "Mars/Olympus")):
        with pytest.raises(M27Error):
            starting_in(seconds, zone, midnight_utc)
