"""`m27 simulate` through a subprocess: table, JSON, plots, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from m27.sim import LabParams, generate_lab, write_jsonl


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "m27.cli", "simulate", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def lab(tmp_path: Path) -> Path:
    path = tmp_path / "lab.jsonl"
    write_jsonl(generate_lab(LabParams(nodes=1, gpus_per_node=2, hours=24.0, seed=2)), path)
    return path


def test_json_report_and_plots(tmp_path: Path) -> None:
    result = simulate("--trace", str(lab(tmp_path)), "--policy", "fifo,best-fit",
                      "--hours", "24", "--format", "json", "--plots", str(tmp_path / "p"))
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert [r["policy"] for r in body["runs"]] == ["fifo", "best-fit"]
    assert body["simulated_gpus"] is True
    for run in body["runs"]:
        assert run["gpus"] == 2
        assert run["hours"] == 24.0
        assert 0 <= run["goodput"] <= run["utilization"] <= 1
    for name in ("utilization.svg", "jct_cdf.svg"):
        root = ET.fromstring((tmp_path / "p" / name).read_text())  # noqa: S314 - ours
        assert root.tag.endswith("svg")
        assert len(root.findall(".//{*}polyline")) >= 2


def test_table_with_a_cluster_override(tmp_path: Path) -> None:
    result = simulate("--trace", str(lab(tmp_path)), "--policy", "by-hand", "--nodes", "2",
                      "--gpus-per-node", "4", "--hours", "12")
    assert result.returncode == 0, result.stderr
    assert "8 simulated GPUs" in result.stdout
    assert result.stdout.splitlines()[2].startswith("by-hand")


def test_bad_trace_is_one_line_with_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "job", "id": "a", "submit_s": 0, "duration_s": 5}\n'
                   '{"type": "job", "id": "b", "submit_s": "soon", "duration_s": 5}\n')
    result = simulate("--trace", str(bad), "--policy", "fifo")
    assert result.returncode == 1
    assert "bad.jsonl:2:" in result.stderr
    assert "submit_s" in result.stderr
    assert "Traceback" not in result.stderr
    missing = simulate("--trace", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 1
    assert "cannot read" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_unknown_policy_is_a_clear_error(tmp_path: Path) -> None:
    result = simulate("--trace", str(lab(tmp_path)), "--policy", "magic")
    assert result.returncode == 1
    assert "unknown policy magic" in result.stderr
    assert "tiresias" in result.stderr
    # ... said before a trace is read (a bad or huge trace is not parsed for nothing)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    early = simulate("--trace", str(tmp_path / "bad.jsonl"), "--policy", "magic")
    assert "unknown policy magic" in early.stderr


def test_help_lists_policies_and_formats() -> None:
    result = simulate("--help")
    assert result.returncode == 0
    for word in ("--trace", "--policy", "--plots", "by-hand", "tiresias", "openb", "Philly"):
        assert word in result.stdout


def test_philly_window_through_the_cli(tmp_path: Path) -> None:
    table = tmp_path / "philly.csv"
    table.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                     "2017-10-09 07:00:00,3600.0,1,3600.0,vc1\n"
                     "2017-10-09 07:30:00,600.0,8,4800.0,vc2\n"
                     "2017-10-12 08:00:00,600.0,1,600.0,vc2\n")
    result = simulate("--trace", str(table), "--policy", "fifo,tiresias", "--start",
                      "2017-10-09", "--days", "1", "--nodes", "1", "--format", "json")
    assert result.returncode == 0, result.stderr
    runs = json.loads(result.stdout)["runs"]
    assert [r["completed"] for r in runs] == [2, 2]
    assert runs[0]["gpus"] == 8
    # the 8-GPU gang waits for the node's last GPU until 08:00 and ends 600 s later
    assert runs[0]["mean_jct_s"] == (3600.0 + 2400.0) / 2
    wrong = simulate("--trace", str(lab(tmp_path)), "--days", "1")
    assert wrong.returncode == 1
    assert "Philly job table only" in wrong.stderr


def test_preemptions_by_kind_and_the_most_preempted_tasks_are_printed() -> None:
    """Thrash is visible: the minimal livelock case's preemptions, by kind and by task."""
    trace = Path(__file__).parent / "minimal_livelock.jsonl"
    result = simulate("--trace", str(trace), "--policy", "m27,fifo", "--hours", "24")
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("m27:")]
    assert "preemptions (prep " in line
    assert "most preempted: prep-" in line
    assert not [x for x in result.stdout.splitlines() if x.startswith("fifo:")]
    body = json.loads(simulate("--trace", str(trace), "--policy", "m27", "--hours", "24",
                               "--format", "json").stdout)
    (run,) = body["runs"]
    assert sum(run["preemptions_by_kind"].values()) == run["preemptions"]
    assert all(count >= 1 for _, count in run["most_preempted"])


def test_generate_writes_the_lab_trace_a_replay_reads(tmp_path: Path) -> None:
    out = tmp_path / "lab16.jsonl"
    made = simulate("--generate", "lab", "--gpus", "16", "--hours", "12", "--seed", "2",
                    "-o", str(out))
    assert made.returncode == 0, made.stderr
    assert f"wrote {out}: the lab workload" in made.stdout
    assert "on 2 × 8 simulated GPUs over 12 h" in made.stdout
    expected = generate_lab(LabParams(nodes=2, gpus_per_node=8, hours=12.0, seed=2))
    assert len(out.read_text().splitlines()) == 1 + len(expected.jobs)  # cluster + jobs
    replay = simulate("--trace", str(out), "--policy", "fifo", "--hours", "12",
                      "--format", "json")
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["jobs"] == len(expected.jobs)
    for args, error in ((["--gpus", "12", "-o", str(out)], "--gpus 12: use 1–8"),
                        (["--gpus", "2"], "--generate needs -o FILE")):
        bad = simulate("--generate", "lab", *args)
        assert bad.returncode == 1
        assert bad.stderr.startswith("m27: ")
        assert error in bad.stderr
