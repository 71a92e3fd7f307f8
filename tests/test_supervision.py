"""The embedded system heals itself (issue 19): under `m27 up` a supervisor owns nats-server
and every service; a process that exits is started again after a backoff, `m27 status`
shows its restarts and last exit, a process that keeps exiting is given up on and reported
as crash-looping, and `m27 down` leaves nothing behind. Real processes, real kills.

The tests share one system and run in order (each leaves it up for the next); the
restart policy is fast (`[supervisor]`: 0.2 s backoff, given up at the 3rd exit).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from m27.client import Client
from m27.common import api_auth
from m27.common.api_auth import ApiAccess
from m27.common.config import SupervisorSection
from m27.embedded import system
from m27.embedded.nats_server import pid_alive
from m27.embedded.system import EmbeddedState
from tests.support import finished_run

pytestmark = pytest.mark.integration

FAST = SupervisorSection(restart_backoff=0.2, restart_backoff_max=1.0, stable_after=60.0,
                         give_up_after=3, give_up_window=120.0)
Status = dict[str, Any]


class Supervised:
    """`m27 up` (one node, one simulated GPU, the FAST policy) in `root/home`."""

    def __init__(self, root: Path) -> None:
        self.home = root / "home"
        self.config = root / "m2config"
        self.config.write_text("")
        self.work = root / "work"
        self.work.mkdir()

    def up(self) -> bool:
        _, started = system.up(self.home, nodes=1, gpus="sim:1", policy=FAST)
        return started

    def state(self) -> EmbeddedState:
        state = system.read_state(self.home)
        assert state is not None
        return state

    def status(self) -> Status:
        """What `m27 status --json` prints (without the dead-letter count)."""
        loaded: Status = json.loads(system.status_json(self.state()))
        return loaded

    def wait_for(self, fact: Callable[[Status], bool], timeout: float = 60.0) -> Status:
        deadline = time.monotonic() + timeout
        while not fact(status := self.status()):
            assert time.monotonic() < deadline, json.dumps(status, indent=1)
            time.sleep(0.1)
        return status

    def m27(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "M27_HOME": str(self.home), "M27_CONFIG": str(self.config)}
        return subprocess.run([sys.executable, "-m", "m27.cli", *args], env=env,
                              capture_output=True, text=True, timeout=120, check=False)

    def client(self) -> Client:
        token = (api_auth.api_dir(self.home) / api_auth.CLI_TOKEN).read_text().strip()
        return Client(self.state().api, access=ApiAccess(token=token))

    def pids(self) -> list[int]:
        """The supervisor's and every process's it started."""
        return [self.state().supervisor_pid, *(p["pid"] for p in self.status()["processes"])]


def process(status: Status, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(p for p in status["processes"] if p["name"] == name)
    return found


def kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    os.kill(pid, sig)
    with contextlib.suppress(ChildProcessError):  # the supervisor: a child of this process
        os.waitpid(pid, 0)


def started_under(home: Path) -> list[int]:
    """Every process (but this one) whose environment names `home` as its M27_HOME."""
    wanted = f"M27_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if wanted in (entry / "environ").read_bytes().split(b"\0") and \
                    pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    root = tmp_path_factory.mktemp("supervised")
    supervised = Supervised(root)
    env = {"M27_HOME": str(supervised.home), "M27_CONFIG": str(supervised.config),
           # a scheduler started again acts (and is ready) once the killed one's lease
           # has run out: 3 s + 2 s here, not 10 s + 2 s
           "M27_SCHEDULER_LEASE": "3s"}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        assert supervised.up()
        yield supervised
    finally:
        system.down(supervised.home)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_a_killed_service_is_started_again_and_status_says_how_it_ended(
        lab: Supervised) -> None:
    before = lab.status()
    assert before["up"] is True
    assert before["supervisor"]["alive"] is True
    assert {p["state"] for p in before["processes"]} == {"running"}
    victim = process(before, "scheduler")
    kill(victim["pid"])
    after = lab.wait_for(lambda s: process(s, "scheduler")["restarts"] == 1 and s["up"])
    scheduler = process(after, "scheduler")
    assert (scheduler["last_exit"], scheduler["state"], scheduler["alive"]) == (
        "SIGKILL", "running", True)
    assert scheduler["pid"] != victim["pid"]
    assert scheduler["grpc_address"] == victim["grpc_address"]  # the same address again
    assert scheduler["last_exit_at"] > 0
    assert [p["restarts"] for p in after["processes"] if p["name"] != "scheduler"] == \
        [0] * (len(after["processes"]) - 1)
    events = [json.loads(line) for line in
              (lab.home / "logs" / "supervisor.log").read_text().splitlines()
              if line.startswith("{")]
    exited = [e for e in events if e["event"] == "supervisor.process_exited"]
    assert [(e["process"], e["pid"], e["exit"]) for e in exited] == [
        ("scheduler", victim["pid"], "SIGKILL")]
    assert any(e["event"] == "supervisor.restarted" and e["process"] == "scheduler"
               for e in events)


async def test_a_killed_nats_server_comes_back_on_its_url_and_work_flows_again(
        lab: Supervised) -> None:
    before = lab.status()
    nats = process(before, "nats-server")
    kill(nats["pid"])
    after = lab.wait_for(lambda s: process(s, "nats-server")["restarts"] == 1 and s["up"])
    assert after["nats_url"] == before["nats_url"]
    assert process(after, "nats-server")["last_exit"] == "SIGKILL"
    # The orchestrator, the scheduler and the node-agent found the bus again by themselves.
    pipeline = "pipeline:\n  - {name: hello, command: 'echo hello > out.txt'}\n"
    async with lab.client() as client:
        run_id = await client.submit(pipeline, workdir=str(lab.work), no_cache=True)
        assert (await finished_run(client, run_id, timeout=60)).state == "succeeded"
    assert (lab.work / "out.txt").read_text() == "hello\n"


def test_a_process_that_keeps_exiting_is_given_up_on_and_reported(lab: Supervised) -> None:
    victim = process(lab.status(), "checkpoint-store")
    lab.config.write_text("[checkpoint]\nkeep_last = -1\n")  # every start now fails at once
    try:
        kill(victim["pid"])
        gave_up = lab.wait_for(lambda s: process(s, "checkpoint-store")["state"] == "gave-up")
    finally:
        lab.config.write_text("")
    store = process(gave_up, "checkpoint-store")
    assert store["crash_looping"] is True
    assert (store["restarts"], store["last_exit"], store["alive"]) == (2, "exit code 2", False)
    assert store["reason"] == "gave up after 3 exits within 2m"
    assert gave_up["up"] is False
    shown = lab.m27("status")
    assert shown.returncode == 1
    line = next(li for li in shown.stdout.splitlines() if "checkpoint-store" in li)
    assert line.lstrip().startswith("DOWN")
    assert "CRASH-LOOPING: gave up after 3 exits within 2m; last exit: exit code 2" in line
    assert "`m27 up` starts what the supervisor gave up on again" in shown.stdout
    # `m27 up` asks the supervisor to start it again; the rest is left as it is.
    others = {p["name"]: p["pid"] for p in gave_up["processes"] if p["alive"]}
    up = lab.m27("up")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "started checkpoint-store again" in up.stdout
    assert "already running" in up.stdout
    again = lab.status()
    assert again["up"] is True
    assert process(again, "checkpoint-store")["restarts"] == 3
    assert {p["name"]: p["pid"] for p in again["processes"] if p["name"] in others} == others


def test_up_after_the_supervisor_died_cleans_up_and_starts_afresh(lab: Supervised) -> None:
    old = lab.pids()
    kill(old[0])
    status = lab.status()
    assert status["supervisor"]["alive"] is False
    assert status["up"] is False
    assert all(pid_alive(pid) for pid in old[1:])  # its processes outlived it
    assert lab.up()  # started anew
    assert not [pid for pid in old if pid_alive(pid)]
    fresh = lab.status()
    assert fresh["up"] is True
    assert {p["restarts"] for p in fresh["processes"]} == {0}


def test_down_leaves_no_process_behind(lab: Supervised) -> None:
    pids = lab.pids()
    assert lab.up() is False  # everything runs: `up` changes nothing
    assert lab.pids() == pids
    down = lab.m27("down")
    assert down.returncode == 0, down.stderr
    assert "m27 stopped" in down.stdout
    assert not [pid for pid in pids if pid_alive(pid)]
    assert started_under(lab.home) == []
    assert system.read_state(lab.home) is None
