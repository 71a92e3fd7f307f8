"""`m27 agent` (issue 17, point 6): a host joins a lab as a node without Kubernetes. Its
--help says what to copy from the head node; a missing piece is one line naming it; and a
second "host" — an M27_HOME of its own holding only the copied node seed and node key —
joins a running `m27 up` (a bus with users) and runs a step placed on it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.embedded.processes import ServiceProcess, wait_ready

pytestmark = pytest.mark.integration

STEP = "pipeline:\n  - name: where\n    type: gpu\n    command: echo ran on $M27_NODE_ID\n"


class M27:
    """The `m27` command in one home, as a user on that machine runs it."""

    def __init__(self, home: Path, config: Path, cwd: Path) -> None:
        self.env = {**os.environ, "M27_HOME": str(home), "M27_CONFIG": str(config)}
        for name in ("M27_API", "M27_TOKEN", "M27_API_KEY_FILE", "M27_API_NODE_KEY_FILE"):
            self.env.pop(name, None)
        self.cwd = cwd

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "m27.cli", *args], env=self.env,
                              cwd=self.cwd, capture_output=True, text=True, timeout=timeout,
                              check=False)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[M27, M27]]:
    """(the head node's m27, the second host's), each with its own home; the head's
    system is brought down at the end."""
    config = tmp_path / "m2config"
    config.write_text("")
    work = tmp_path / "work"
    work.mkdir()
    head = M27(tmp_path / "head", config, work)
    second = M27(tmp_path / "host2", config, work)
    (tmp_path / "host2").mkdir()
    yield head, second
    head("down", timeout=60)


def test_agent_help_says_what_a_host_needs_from_the_head_node() -> None:
    text = subprocess.run([sys.executable, "-m", "m27.cli", "agent", "--help"],
                          capture_output=True, text=True, check=True).stdout
    for needed in ("--nats URL", "--creds FILE", "--node-id NAME", "--gpus SPEC",
                   "node-<ID>.nk", "node.key", "m27 bus credentials DIR --nodes ID",
                   "m27 api keys DIR", "python -m m27.node_agent", "comma-separated"):
        assert needed in text, needed
    listing = subprocess.run([sys.executable, "-m", "m27.cli", "--help"],
                             capture_output=True, text=True, check=True).stdout
    assert "m27 agent --nats URL --creds FILE" in listing


def test_a_missing_seed_or_key_is_one_line_naming_what_to_copy(tmp_path: Path) -> None:
    config = tmp_path / "m2config"
    config.write_text("")
    second = M27(tmp_path / "host2", config, tmp_path)
    args = ("agent", "--nats", "nats://127.0.0.1:1", "--node-id", "gpu-02")
    no_seed = second(*args)
    assert no_seed.returncode == 1
    assert no_seed.stderr.count("\n") == 1, no_seed.stderr
    assert "copy node-gpu-02.nk from the head node" in no_seed.stderr
    assert "m27 bus credentials DIR --nodes gpu-02" in no_seed.stderr
    made = second("bus", "credentials", str(tmp_path / "creds"), "--nodes", "gpu-02")
    assert made.returncode == 0, made.stderr
    seed = tmp_path / "creds" / "node-gpu-02.nk"
    no_key = second(*args, "--creds", str(seed))
    assert no_key.returncode == 1
    assert no_key.stderr.count("\n") == 1, no_key.stderr
    assert "copy node.key from the head node" in no_key.stderr
    seed.chmod(0o644)
    shared = second(*args, "--creds", str(seed))
    assert "chmod 600" in shared.stderr
    assert "Traceback" not in no_seed.stderr + no_key.stderr + shared.stderr


def test_a_second_host_joins_a_running_system_and_runs_a_step_placed_on_it(
        hosts: tuple[M27, M27], tmp_path: Path) -> None:
    head, second = hosts
    up = head("up", "--gpus", "sim:1")
    assert up.returncode == 0, up.stderr
    head_home = Path(head.env["M27_HOME"])
    # On the head: a seed for the new node where `m27 up` keeps its bus's, then `m27 up`
    # again lets it onto the running bus.
    made = head("bus", "credentials", str(head_home / "credentials" / "nats"),
                "--nodes", "gpu-02")
    assert made.returncode == 0, made.stderr
    admitted = head("up")
    assert "admitted node(s) gpu-02" in admitted.stdout, admitted.stdout + admitted.stderr
    # What is copied to the second host: the node's seed and the node API key, nothing else.
    host = Path(second.env["M27_HOME"])
    for source in (head_home / "credentials" / "nats" / "node-gpu-02.nk",
                   head_home / "credentials" / "api" / "node.key"):
        shutil.copy2(source, host / source.name)
    status = json.loads(head("status", "--json").stdout)
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "m27.cli", "agent", "--nats", status["nats_url"],
             "--creds", str(host / "node-gpu-02.nk"), "--node-key", str(host / "node.key"),
             "--node-id", "gpu-02", "--gpus", "sim:1", "--ready-file", str(host / "ready")],
            env=second.env, cwd=second.cwd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready([ServiceProcess(name="agent", module="m27.node_agent", pid=agent.pid,
                                   log_path=str(log), ready_file=str(host / "ready"))])
        nodes = head("nodes", "--json")
        assert {"node-1", "gpu-02"} <= {n["node_id"] for n in json.loads(nodes.stdout)}
        assert head("node", "cordon", "node-1").returncode == 0  # so it goes to gpu-02
        (head.cwd / "where.yaml").write_text(STEP)
        run = head("submit", "where.yaml", "--watch")
        assert run.returncode == 0, run.stdout + run.stderr + log.read_text()[-3000:]
        shown = head("show", run.stdout.split()[0], "--json")
        step = json.loads(shown.stdout)["steps"][0]
        assert step["node_id"] == "gpu-02", step
        assert "ran on gpu-02" in step["stdout_tail"]
        assert not any(host.glob("credentials/nats/*.nk"))  # it needed no other seed
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
