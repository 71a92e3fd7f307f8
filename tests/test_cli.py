"""The `m27` command as users run it: up, status, submit, watch, runs, show, cancel, down, demo.

Every test uses its own $M27_HOME, so it starts (and stops) its own embedded system.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.embedded.nats_server import pid_alive

pytestmark = pytest.mark.integration


class M27:
    def __init__(self, home: Path, config: Path, cwd: Path) -> None:
        self.env = {**os.environ, "M27_HOME": str(home), "M27_CONFIG": str(config)}
        self.env.pop("M27_API", None)
        self.cwd = cwd

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "m27.cli", *args], env=self.env,
                              cwd=self.cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def m27(tmp_path: Path) -> Iterator[M27]:
    config = tmp_path / "m2config"
    config.write_text("")
    work = tmp_path / "work"
    work.mkdir()
    cli = M27(tmp_path / "home", config, work)
    yield cli
    cli("down", timeout=60)



def test_commands_say_clearly_when_nothing_runs(m27: M27) -> None:
    status = m27("status")
    assert status.returncode == 1
    assert "not running" in status.stdout
    assert json.loads(m27("status", "--json").stdout)["up"] is False
    runs = m27("runs")
    assert runs.returncode == 1
    assert runs.stderr.startswith("m27: nothing is running under ")
    assert "m27 up" in runs.stderr
    assert "Traceback" not in runs.stderr


def test_help_explains_every_command(m27: M27) -> None:
    text = m27("--help").stdout
    for command in ("up", "down", "status", "submit", "watch", "runs", "show", "cancel",
                    "demo"):
        assert command in text
    assert "--var NAME=VALUE" in m27("submit", "--help").stdout


def test_the_whole_lifecycle_on_one_machine(m27: M27) -> None:
    up = m27("up", "--nodes", "2")
    assert up.returncode == 0, up.stderr
    assert "m27 started" in up.stdout
    assert "simulated" in up.stdout
    assert "already running" in m27("up").stdout
    status = json.loads(m27("status", "--json").stdout)
    assert status["up"] is True
    assert status["nats_url"].startswith("nats://127.0.0.1:")
    assert status["api"].startswith("127.0.0.1:")
    assert status["dead_letters"] == 0  # the dead-letter stream exists and is empty
    names = [p["name"] for p in status["processes"]]
    assert names == ["nats-server", "orchestrator", "scheduler", "checkpoint-store", "report",
                     "node-agent-1", "node-agent-2"]
    pids = [p["pid"] for p in status["processes"]]
    assert all(pid_alive(pid) for pid in pids)

    good = m27.cwd / "good.yaml"
    good.write_text("pipeline:\n  - name: hello\n    type: gpu_light\n"
                    "    command: printf '%s' {{MSG}} > out.txt\n")
    submitted = m27("submit", str(good), "--var", "MSG=hi; touch pwned")
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    watched = m27("watch", run_id)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "run succeeded" in watched.stdout
    assert (m27.cwd / "out.txt").read_text() == "hi; touch pwned"
    assert not (m27.cwd / "pwned").exists()

    bad = m27.cwd / "bad.yaml"
    bad.write_text("pipeline:\n  - name: a\n    command: 'echo no input file >&2; exit 7'\n"
                   "  - name: b\n    depends_on: [a]\n    command: echo\n")
    failing = m27("submit", str(bad), "--watch")
    assert failing.returncode == 1
    failed_id = failing.stdout.strip()
    # the watch ends with what failed, the end of its stderr and where to look next
    assert "step a failed (exit 7 on " in failing.stderr
    assert "  its stderr ends with:\n    no input file\n" in failing.stderr
    assert f"m27 logs {failed_id} a; every attempt: m27 show {failed_id}" in failing.stderr
    shown = json.loads(m27("show", failed_id, "--json").stdout)
    assert [(s["name"], s["state"], s["exit_code"]) for s in shown["steps"]] == [
        ("a", "failed", 7), ("b", "skipped", None)]

    listed = m27("runs").stdout
    assert run_id in listed
    assert failed_id in listed
    # no service log holds a --var value (docs/security.md)
    logs = Path(m27.env["M27_HOME"]) / "logs"
    assert not [p.name for p in logs.glob("*.log") if "touch pwned" in p.read_text()]
    # every service did all of this within its bus permissions (docs/security.md)
    nats_log = (Path(m27.env["M27_HOME"]) / "nats" / "nats.log").read_text()
    assert "Permissions Violation" not in nats_log
    assert "Authorization Violation" not in nats_log

    down = m27("down")
    assert down.returncode == 0
    deadline = time.monotonic() + 20
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in pids)
    assert m27("status").returncode == 1

    # the system is down: history is read from the JetStream data it stored
    offline = m27("runs")
    assert offline.returncode == 0, offline.stderr
    assert run_id in offline.stdout
    assert failed_id in offline.stdout
    assert "m27 is not running: these are the runs stored under" in offline.stderr
    assert [line.split()[2] for line in offline.stdout.splitlines()[1:3]] == [
        "failed", "succeeded"]  # newest first, as the API lists them
    only_failed = m27("runs", "--state", "failed", "--json")
    assert [r["run_id"] for r in json.loads(only_failed.stdout)["runs"]] == [failed_id]
    shown = json.loads(m27("show", failed_id, "--json").stdout)
    assert [(s["name"], s["state"], s["exit_code"]) for s in shown["steps"]] == [
        ("a", "failed", 7), ("b", "skipped", None)]
    unknown = m27("show", "r-20200101-000000-abcdef")
    assert unknown.returncode == 1
    assert "no run 'r-20200101-000000-abcdef'" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    refused = m27("cancel", run_id)  # changing a run needs the system
    assert refused.returncode == 1
    assert "m27 up" in refused.stderr
    assert m27("status").returncode == 1  # reading history started nothing that stays


def test_cancel_from_the_command_line(m27: M27) -> None:
    assert m27("up").returncode == 0
    long = m27.cwd / "long.yaml"
    long.write_text("pipeline:\n  - {name: wait, command: 'sleep 120'}\n")
    run_id = m27("submit", str(long)).stdout.strip()
    deadline = time.monotonic() + 20
    while "running" not in m27("show", run_id).stdout and time.monotonic() < deadline:
        time.sleep(0.2)
    cancel = m27("cancel", run_id, "--reason", "changed my mind")
    assert cancel.returncode == 0
    watched = m27("watch", run_id)
    assert watched.returncode == 3
    assert "cancelled" in watched.stdout


def test_bad_pipelines_are_reported_with_their_location(m27: M27) -> None:
    assert m27("up").returncode == 0
    broken = m27.cwd / "broken.yaml"
    broken.write_text("pipeline:\n  - name: a\n    typ: gpu\n    command: echo {{X}}\n")
    result = m27("submit", str(broken))
    assert result.returncode == 1
    assert "broken.yaml:3:5: pipeline[0].typ: unknown key `typ` (did you mean `type`?)" \
        in result.stderr
    assert "undefined variable `X`" in result.stderr
    assert "Traceback" not in result.stderr
    assert m27("submit", str(m27.cwd / "missing.yaml")).stderr.strip().endswith(
        "missing.yaml: no such file")
    assert "expects NAME=VALUE" in m27("submit", str(broken), "--var", "novalue").stderr


@pytest.mark.slow
def test_demo_runs_to_a_finished_report(m27: M27) -> None:
    demo = m27("demo", "--epochs", "6", "--spike-epoch", "2", "--down", timeout=300)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert demo.stderr.rstrip().endswith("m27: stopped the system the demo started (--down)")
    assert m27("status").returncode == 1  # nothing left running
    report = Path(demo.stdout.strip().rsplit("report: ", 1)[1])
    html = report.read_text()
    for step in ("preprocessing", "training", "analysis"):
        assert step in html
    assert "simulated" in html
    workdir = Path(demo.stdout.split("working in ", 1)[1].split(")", 1)[0])
    analysis = json.loads((workdir / "analysis.json").read_text())
    assert analysis["test_samples"] > 0
    assert 0.0 <= analysis["accuracy"] <= 1.0
    # the blunder at epoch 2 is a loss spike: the training step's monitor caught it and
    # asked for a checkpoint (whether the program still ran to get the signal depends on
    # how fast these cores are; tests/test_node_agent.py checks the delivery), and a
    # signal at any moment never failed the step (it succeeded above)
    agent_log = "".join(p.read_text() for p in (Path(m27.env["M27_HOME"]) / "logs").glob(
        "node-agent*.log"))
    anomalies = [json.loads(line) for line in agent_log.splitlines()
                 if '"task.training_anomaly"' in line]
    assert anomalies, agent_log[-2000:]
    assert (anomalies[0]["kind"], anomalies[0]["metric"]) == ("spike", "batch_loss")
    assert any(('"task.checkpoint_requested"' in line and "training anomaly" in line)
               or '"task.checkpoint_ignored"' in line for line in agent_log.splitlines())


def test_plan_works_without_a_running_system(m27: M27) -> None:
    sweep = m27.cwd / "sweep.yaml"
    sweep.write_text("""pipeline:
  - {name: prep, command: x, output: d.csv}
  - name: train
    depends_on: [prep]
    matrix: {lr: [1, 2], seed: [1, 2, 3]}
    max_parallel: 2
    resources: {gpus: 0.5}
    command: "train {{matrix.lr}} {{matrix.seed}} {{steps.prep.output}}"
  - {name: compare, depends_on: [train], command: x}
""")
    text = m27("plan", str(sweep))
    assert text.returncode == 0, text.stderr
    assert "plan for sweep: 8 steps in 3 level(s)" in text.stdout
    assert "train ×6 (at most 2 at once) gpu_light, 0.5 GPU, 1 CPU" in text.stdout
    assert "critical path: prep → train-lr1-seed1 → compare" in text.stdout
    assert "no running system" in text.stdout
    plan = json.loads(m27("plan", str(sweep), "--format", "json").stdout)
    assert [s["level"] for s in plan["steps"]] == [0] + [1] * 6 + [2]
    assert plan["steps"][1]["command"].endswith(f"{m27.cwd}/d.csv")
    broken = m27.cwd / "broken.yaml"
    broken.write_text("pipeline:\n  - {name: a, command: x, depends_on: [a]}\n")
    result = m27("plan", str(broken))
    assert result.returncode == 1
    assert "step `a` depends on itself" in result.stderr


def test_history_retry_and_cancel_of_one_step_from_the_command_line(m27: M27) -> None:
    assert m27("up").returncode == 0
    flaky = m27.cwd / "flaky.yaml"
    flaky.write_text("pipeline:\n  - {name: first, command: 'true'}\n"
                     "  - {name: second, command: 'test -f ok', depends_on: [first]}\n")
    failed_id = m27("submit", str(flaky), "--watch", "--user", "cli-test").stdout.strip()
    listed = json.loads(m27("runs", "--state", "failed", "--user", "cli-test",
                            "--json").stdout)
    assert [r["run_id"] for r in listed["runs"]] == [failed_id]
    assert json.loads(m27("runs", "--since", "1h", "--json").stdout)["runs"]
    assert "--since expects" in m27("runs", "--since", "yesterday-ish").stderr
    (m27.cwd / "ok").write_text("")
    retry = m27("retry", failed_id, "--watch")
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert "1 step(s) will run again (second)" in retry.stdout
    shown = m27("show", failed_id).stdout
    assert "second" in shown
    assert "attempt 2" in shown
    again = m27("retry", failed_id)
    assert again.returncode == 1
    assert again.stderr == f"m27: run {failed_id} succeeded: every step has its results\n"

    two = m27.cwd / "two.yaml"
    two.write_text("pipeline:\n  - {name: slow, command: 'sleep 120'}\n"
                   "  - {name: quick, command: 'sleep 1'}\n")
    run_id = m27("submit", str(two)).stdout.strip()
    deadline = time.monotonic() + 20
    while "slow                     cpu       running" not in m27("show", run_id).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancel = m27("cancel", run_id, "--step", "slow")
    assert cancel.returncode == 0, cancel.stderr
    watched = m27("watch", run_id)
    assert watched.returncode == 3
    states = {s["name"]: s["state"] for s in json.loads(m27("show", run_id, "--json").stdout)
              ["steps"]}
    assert states == {"slow": "cancelled", "quick": "succeeded"}
