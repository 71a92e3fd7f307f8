"""The node-agent as users run it: a real process against a real nats-server.

Each test starts `python -m m27.node_agent --node-id n1 --gpus sim:2`, sends commands the way
the scheduler does (JetStream, `m27.cmd.node.n1`) and watches the events it publishes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from nats.aio.msg import Msg

from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.common.ids import new_run_id, task_id
from m27.common.model import Fence, MonitorSpec, NodeInfo
from m27.embedded.nats_server import pid_alive
from m27.embedded.processes import ServiceProcess

pytestmark = pytest.mark.integration

NODE = "n1"
AGENT_ARGS = ("--node-id", NODE, "--gpus", "sim:2", "--heartbeat-interval", "1s")
E = TypeVar("E", bound=events.Event)


class Watch:
    """Every event and heartbeat seen on core NATS since the test began."""

    def __init__(self) -> None:
        self.seen: list[events.Event] = []
        self._changed = asyncio.Event()

    async def on_message(self, msg: Msg) -> None:
        self.seen.append(events.decode_event(msg.data))
        self._changed.set()

    async def wait_for(self, kind: type[E], predicate: Callable[[E], bool] = lambda _: True,
                       timeout: float = 15.0) -> E:
        """The first event of `kind` matching `predicate`, waiting for it up to `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.seen:
                if isinstance(event, kind) and predicate(event):
                    return event
            left = deadline - time.monotonic()
            if left <= 0:
                kinds = [type(e).__name__ for e in self.seen[-20:]]
                raise AssertionError(f"no matching {kind.__name__} within {timeout}s; "
                                     f"last events: {kinds}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                continue

    def all(self, kind: type[E], predicate: Callable[[E], bool] = lambda _: True) -> list[E]:
        return [e for e in self.seen if isinstance(e, kind) and predicate(e)]


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[NatsBus]:
    bus = await NatsBus.open(nats_url, name="test")
    yield bus
    await bus.close()


@pytest.fixture
async def watch(bus: NatsBus) -> Watch:
    watch = Watch()
    await bus.nc.subscribe(subjects.EVENTS_ALL, cb=watch.on_message)
    await bus.nc.subscribe(subjects.heartbeat(NODE), cb=watch.on_message)
    await bus.nc.flush()
    return watch


@pytest.fixture
def agent(start_service: Any, watch: Watch) -> ServiceProcess:
    proc: ServiceProcess = start_service("node_agent", *AGENT_ARGS)
    return proc


def start_cmd(command: str = "true", *, run_id: str | None = None, step: str = "s1",
              attempt: int = 1,
              **changes: Any) -> events.StartTask:
    run = run_id or new_run_id(time.time())
    fields: dict[str, Any] = {
        "at": time.time(), "task_id": task_id(run, step), "run_id": run, "step": step,
        "attempt": attempt, "step_type": "cpu", "command": command,
    }
    fields.update(changes)
    return events.StartTask(**fields)


async def send(bus: NatsBus, command: events.NodeCommand, *, fence: bool = True) -> None:
    """Publish a command as the scheduler does: a start comes with its fencing token."""
    if isinstance(command, events.StartTask) and fence:
        await assign(bus, command.task_id, command.attempt, NODE)
    await bus.publish(subjects.node_commands(NODE), command)


async def assign(bus: NatsBus, task: str, attempt: int, node: str) -> None:
    """As the scheduler assigns: the fencing token's attempt only grows."""
    def grow(current: Fence | None) -> Fence | None:
        if current is not None and current.attempt >= attempt:
            return None
        return Fence(task_id=task, attempt=attempt, node_id=node, at=time.time())

    await bus.kv_update(subjects.FENCES_BUCKET, subjects.task_key(task), Fence, grow)


def workdir(home: Path, cmd: events.StartTask) -> Path:
    return home / "runs" / cmd.run_id / "work"


async def wait_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout}s")


async def wait_dead(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} still alive after {timeout}s")
        await asyncio.sleep(0.05)


def of(cmd: events.StartTask) -> Callable[[Any], bool]:
    return lambda e: e.task_id == cmd.task_id and e.attempt == cmd.attempt


# ---------------------------------------------------------------- registration and liveness


async def test_registers_the_node_with_two_simulated_gpus(agent: ServiceProcess, bus: NatsBus,
                                                          watch: Watch) -> None:
    registered = await watch.wait_for(events.NodeRegistered)
    assert registered.node_id == NODE
    assert registered.backend == "simulated"
    assert [g.uuid for g in registered.gpus] == ["SIM-n1-0", "SIM-n1-1"]
    assert all(g.simulated and "simulated" in g.name for g in registered.gpus)
    found = await bus.kv_get(subjects.NODES_BUCKET, NODE, NodeInfo)
    assert found is not None
    info = found[0]
    assert (info.state, info.backend, len(info.gpus), info.pid) == \
        ("up", "simulated", 2, agent.pid)
    assert all(g.simulated for g in info.gpus)


async def test_auto_without_an_nvidia_gpu_runs_cpu_only_and_says_so(
        start_service: Any, bus: NatsBus, watch: Watch) -> None:
    proc = start_service("node_agent", "--node-id", NODE, "--gpus", "auto")
    registered = await watch.wait_for(events.NodeRegistered)
    if registered.backend == "nvml":
        assert registered.gpus
        assert not any(g.simulated for g in registered.gpus)
        return
    assert (registered.backend, registered.gpus) == ("none", ())
    assert "--gpus sim:N simulates" in Path(proc.log_path).read_text()
    services = await bus.kv_keys(subjects.SERVICES_BUCKET)
    assert f"node-agent.{NODE}" in services


async def test_heartbeats_arrive_every_interval_and_refresh_the_node_record(
        agent: ServiceProcess, bus: NatsBus, watch: Watch) -> None:
    first = await watch.wait_for(events.NodeHeartbeat)
    second = await watch.wait_for(events.NodeHeartbeat, lambda h: h.at > first.at)
    assert 0.5 < second.at - first.at < 3.0
    assert second.backend == "simulated"
    assert [s.index for s in second.gpus] == [0, 1]
    assert all(s.utilization_pct == 0 for s in second.gpus)
    found = await bus.kv_get(subjects.NODES_BUCKET, NODE, NodeInfo)
    assert found is not None
    assert found[0].last_heartbeat >= first.at


def guards_of(agent_pid: int) -> list[int]:
    """The live guard processes an agent started (`_guard.py … --agent-pid PID`)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(a.endswith(b"_guard.py") for a in argv) and \
                str(agent_pid).encode() in argv:
            found.append(int(entry))
    return found


async def test_a_killed_guard_is_started_again(agent: ServiceProcess, watch: Watch) -> None:
    """Found by the chaos suite: a guard killed -9 stayed dead, and nobody said so; the node
    then had only its agent to fence it."""
    await watch.wait_for(events.NodeRegistered)
    await wait_until(lambda: len(guards_of(agent.pid)) == 1, "the guard starts")
    (first,) = guards_of(agent.pid)
    os.kill(first, signal.SIGKILL)
    await wait_until(lambda: [p for p in guards_of(agent.pid) if p != first],
                     "the agent starts its guard again")
    assert len(guards_of(agent.pid)) == 1
    assert "node.guard_died" in Path(agent.log_path).read_text()


async def wait_until(check: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


BUSY = '"$M27_PYTHON" -c "while True: pass"'


async def test_simulated_gpus_show_what_their_tasks_do(agent: ServiceProcess, bus: NatsBus,
                                                       watch: Watch) -> None:
    """A busy task's share shows as utilization, a sleeping one's as idle; memory is the
    task's resident memory — all marked simulated."""
    busy = start_cmd(BUSY, step_type="gpu_light", gpu_ids=(1,), gpu_share=0.5)
    idle = start_cmd("sleep 300", run_id=busy.run_id, step="idle", step_type="gpu_light",
                     gpu_ids=(0,), gpu_share=0.5)
    for cmd in (busy, idle):
        await send(bus, cmd)
    beat = await watch.wait_for(
        events.NodeHeartbeat,
        lambda h: {busy.task_id, idle.task_id} <= set(h.running) and h.gpus[1].utilization_pct
        > 35, timeout=20)
    assert beat.gpus[1].utilization_pct <= 50.5
    assert beat.gpus[0].utilization_pct < 5
    assert all(g.simulated for g in beat.gpus)
    assert beat.gpus[1].memory_used_mb > 0
    assert {p.task_id for p in beat.gpus[1].processes} == {busy.task_id}
    went_idle = await watch.wait_for(events.TaskIdle, of(idle), timeout=20)
    assert (went_idle.reason, went_idle.idle_share, went_idle.gpu_ids) == ("gpu_idle", 0.5,
                                                                           (0,))
    assert not watch.all(events.TaskIdle, of(busy))
    for cmd in (busy, idle):
        await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                        grace_s=2))
    exited = await watch.wait_for(events.TaskExited, of(busy))
    assert exited.energy_j is not None
    assert exited.energy_j > 0
    await watch.wait_for(events.NodeHeartbeat, lambda h: h.at > beat.at and not h.running)


async def test_a_reported_io_phase_is_idle_at_once(agent: ServiceProcess, bus: NatsBus,
                                                   watch: Watch) -> None:
    cmd = start_cmd('"$M27_PYTHON" -c "import m27.train, time; m27.train.report_phase('
                    "'io'); time.sleep(300)\"", step_type="gpu_light", gpu_ids=(0,),
                    gpu_share=0.3)
    await send(bus, cmd)
    went_idle = await watch.wait_for(events.TaskIdle, of(cmd), timeout=10)
    assert went_idle.reason == "io_phase"
    await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                    grace_s=2))
    await watch.wait_for(events.TaskExited, of(cmd))


async def test_idle_is_seen_between_heartbeats(start_service: Any, bus: NatsBus,
                                                watch: Watch) -> None:
    """Utilization is read every `sample_interval` (1 s), not every heartbeat (8 s here):
    a stalled task is idle after three such samples, before a second heartbeat shows it."""
    start_service("node_agent", "--node-id", NODE, "--gpus", "sim:1",
                  "--heartbeat-interval", "8s", "--sample-interval", "1s")
    cmd = start_cmd("sleep 300", step_type="gpu_light", gpu_ids=(0,), gpu_share=0.5)
    await send(bus, cmd)
    went_idle = await watch.wait_for(events.TaskIdle, of(cmd), timeout=30)
    assert went_idle.reason == "gpu_idle"
    beats = [h for h in watch.all(events.NodeHeartbeat)
             if cmd.task_id in h.running and h.at <= went_idle.at]
    assert len(beats) <= 1, [h.at for h in beats]
    await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                    grace_s=2))
    await watch.wait_for(events.TaskExited, of(cmd))


async def test_metrics_use_the_dcgm_exporter_names(agent: ServiceProcess, bus: NatsBus,
                                                   watch: Watch) -> None:
    import urllib.request

    await watch.wait_for(events.NodeHeartbeat)
    got = await bus.kv_get(subjects.NODES_BUCKET, NODE, NodeInfo)
    assert got is not None
    address = got[0].metrics_address
    assert address
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode())
    for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP",
                 "DCGM_FI_DEV_POWER_USAGE"):
        assert f"\n{name}{{" in text
    assert 'm27_simulated="true"' in text


SPIKE = """\
import json, os, signal, time
asked = []
signal.signal(signal.SIGUSR1, lambda *_: asked.append(time.time()))
with open(os.environ["M27_METRICS_FILE"], "a") as metrics:
    for step in range(40):
        metrics.write(json.dumps({"step": step, "loss": 1.0 + 0.01 * (step % 3)}) + "\\n")
    metrics.write(json.dumps({"step": 40, "loss": 50.0, "acc": 0.5}) + "\\n")
deadline = time.time() + 30
while not asked and time.time() < deadline:
    time.sleep(0.05)
open("asked.txt", "w").write(repr(asked))
"""


async def test_a_loss_spike_is_an_event_and_asks_the_step_to_checkpoint_at_once(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path,
        tmp_path: Path) -> None:
    """The step's `monitor:` (here `loss` with the defaults): the spike is found in the
    metrics file the agent tails, published as `training_anomaly` on the step's task
    subject, and the step gets its checkpoint signal while it still runs."""
    script = tmp_path / "spike.py"
    script.write_text(SPIKE)
    cmd = start_cmd(f'"$M27_PYTHON" {script}', monitor=(MonitorSpec(),))
    await send(bus, cmd)
    anomaly = await watch.wait_for(events.TrainingAnomaly, of(cmd), timeout=20)
    assert (anomaly.kind, anomaly.metric, anomaly.train_step, anomaly.value) == (
        "spike", "loss", 40, 50.0)
    assert anomaly.baseline == pytest.approx(1.01)
    assert (anomaly.node_id, anomaly.actions) == (NODE, ("checkpoint", "notify"))
    exited = await watch.wait_for(events.TaskExited, of(cmd), timeout=40)
    assert (exited.cause, exited.exit_code) == ("exit", 0)
    asked = (workdir(m27_home, cmd) / "asked.txt").read_text()
    assert asked != "[]", "the step was never asked to checkpoint"
    assert len(watch.all(events.TrainingAnomaly, of(cmd))) == 1


async def test_nan_with_on_anomaly_stop_ends_the_attempt_with_cause_anomaly(
        agent: ServiceProcess, bus: NatsBus, watch: Watch) -> None:
    cmd = start_cmd(
        "printf '{\"step\": 1, \"loss\": 0.5}\\n{\"step\": 2, \"loss\": NaN}\\n' "
        '>> "$M27_METRICS_FILE"; sleep 300',
        monitor=(MonitorSpec(on_anomaly=("stop",)),))
    await send(bus, cmd)
    anomaly = await watch.wait_for(events.TrainingAnomaly, of(cmd), timeout=20)
    assert (anomaly.kind, anomaly.train_step, anomaly.value, anomaly.actions) == (
        "nan", 2, "NaN", ("stop",))
    exited = await watch.wait_for(events.TaskExited, of(cmd), timeout=30)
    assert exited.cause == "anomaly"
    assert "training anomaly: loss is nan at step 2" in exited.reason


async def test_a_task_over_its_gpu_memory_share_is_warned_then_stopped(
        start_service: Any, bus: NatsBus, watch: Watch) -> None:
    start_service("node_agent", "--node-id", NODE, "--gpus", "sim:1x256MiB",
                  "--heartbeat-interval", "1s")
    hog = start_cmd('"$M27_PYTHON" -c "import time; x = bytearray(150 << 20); '
                    'x[::4096] = b\\"1\\" * len(x[::4096]); time.sleep(300)"',
                    step_type="gpu_light", gpu_ids=(0,), gpu_share=0.1)
    await send(bus, hog)
    warned = await watch.wait_for(events.TaskOverShare,
                                  lambda e: of(hog)(e) and e.action == "warned", timeout=20)
    assert warned.used_mb > warned.limit_mb
    exited = await watch.wait_for(events.TaskExited, of(hog), timeout=20)
    assert exited.cause == "over_share"
    await watch.wait_for(events.TaskOverShare, lambda e: of(hog)(e) and e.action == "stopped")
    assert len(watch.all(events.TaskOverShare,
                         lambda e: of(hog)(e) and e.action == "stopped")) == 1


# ---------------------------------------------------------------- running steps


async def test_a_failing_step_reports_its_exit_code_and_stderr_tail(
        agent: ServiceProcess, bus: NatsBus, watch: Watch) -> None:
    cmd = start_cmd("echo hi; echo oops >&2; exit 3")
    await send(bus, cmd)
    started = await watch.wait_for(events.TaskStarted, of(cmd))
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert watch.seen.index(started) < watch.seen.index(exited)
    assert (exited.exit_code, exited.signal, exited.started) == (3, None, True)
    assert (exited.cause, exited.reason) == ("exit", "exit code 3")
    assert exited.stdout_tail == "hi\n"
    assert "oops" in exited.stderr_tail
    assert exited.started_at == started.at
    assert exited.node_id == started.node_id == NODE
    assert Path(exited.stdout_path).read_text() == "hi\n"
    assert Path(exited.stderr_path).read_text() == "oops\n"
    assert Path(exited.stderr_path).name == "s1.1.err"


async def test_the_step_gets_its_placement_in_its_environment(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    line = 'echo "$M27_TASK_ID $CUDA_VISIBLE_DEVICES $M27_GPU_BACKEND $M27_GPU_SHARE" > env.txt'
    gpu = start_cmd(line, step="train", step_type="gpu", gpu_ids=(1,), gpu_share=1.0,
                    env={"SEED": "7"}, checkpoint_interval_s=300.0)
    cpu = start_cmd(line + '; echo "[$CUDA_VISIBLE_DEVICES] $SEED $M27_CHECKPOINT_DIR" >> env.txt'
                    ' ; echo "$M27_PYTHON" >> env.txt', run_id=gpu.run_id, step="prep",
                    env={"SEED": "7"})
    for cmd in (gpu, cpu):
        await send(bus, cmd)
        exited = await watch.wait_for(events.TaskExited, of(cmd))
        assert exited.exit_code == 0, exited.stderr_tail
        text = (workdir(m27_home, cmd) / "env.txt").read_text().splitlines()
        if cmd is gpu:
            assert text == [f"{gpu.task_id} 1 simulated 1"]
        else:
            checkpoints = m27_home / "runs" / cpu.run_id / "checkpoints" / "prep"
            assert text[0] == f"{cpu.task_id}  none 0"
            assert text[1] == f"[] 7 {checkpoints}"
            assert Path(text[2]).name.startswith("python")
            assert checkpoints.is_dir()


async def test_a_hostile_command_string_is_run_by_sh_exactly_as_given(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path, tmp_path: Path) -> None:
    hostile = ("printf '%s|' \"$(echo sub)\" '$M27_STEP' \"`echo tick`\" ';rm -rf /;' "
               "'\"quoted\"' 'back\\slash' ünïcødé  $((6*7)) > out.txt\n"
               "echo 'second line' >> out.txt; # trailing comment ' \"")
    cmd = start_cmd(hostile)
    await send(bus, cmd)
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert exited.exit_code == 0, exited.stderr_tail
    reference = tmp_path / "reference"
    reference.mkdir()
    await asyncio.to_thread(subprocess.run, ["/bin/sh", "-c", hostile], cwd=reference,
                            check=True)
    expected = (reference / "out.txt").read_text()
    assert (workdir(m27_home, cmd) / "out.txt").read_text() == expected
    assert expected.startswith("sub|$M27_STEP|tick|;rm -rf /;|\"quoted\"|back\\slash|")


@pytest.mark.parametrize(("changes", "why"), [
    ({"workdir": "/nonexistent/m27-test"}, "/nonexistent/m27-test"),
    ({"command": "echo a\0b"}, "null"),
    ({"gpu_ids": (5,), "step_type": "gpu"}, "GPU 5 not on this node"),
])
async def test_a_step_that_cannot_start_is_reported_not_started(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, changes: dict[str, Any],
        why: str) -> None:
    cmd = start_cmd(**{"command": "true", **changes})
    await send(bus, cmd)
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert (exited.started, exited.exit_code, exited.cause) == (False, 127, "not_started")
    assert exited.reason.startswith("could not start: ")
    assert why in exited.reason
    assert not watch.all(events.TaskStarted, of(cmd))


# ---------------------------------------------------------------- stopping


async def test_stop_task_kills_the_whole_process_group(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    cmd = start_cmd("sleep 300 & echo $! > child.pid; sleep 300")
    await send(bus, cmd)
    started = await watch.wait_for(events.TaskStarted, of(cmd))
    child = int(await wait_file(workdir(m27_home, cmd) / "child.pid"))
    assert pid_alive(started.pid)
    assert pid_alive(child)
    await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                    grace_s=10, reason="preempted"))
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert (exited.exit_code, exited.signal) == (128 + signal.SIGTERM, signal.SIGTERM)
    assert (exited.cause, exited.reason) == ("stopped", "killed by SIGTERM: stopped: preempted")
    await wait_dead(started.pid, timeout=2)
    await wait_dead(child, timeout=2)


async def test_a_group_that_ignores_sigterm_is_killed_after_the_grace(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    cmd = start_cmd("trap '' TERM; sleep 300 & echo $! > child.pid; wait")
    await send(bus, cmd)
    started = await watch.wait_for(events.TaskStarted, of(cmd))
    child = int(await wait_file(workdir(m27_home, cmd) / "child.pid"))
    sent = time.monotonic()
    await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                    grace_s=0.5))
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert time.monotonic() - sent >= 0.5
    assert (exited.exit_code, exited.signal) == (137, signal.SIGKILL)
    assert exited.reason == "killed by SIGKILL: stopped (SIGKILL after 0.5s grace)"
    await wait_dead(started.pid, timeout=2)
    await wait_dead(child, timeout=2)


CHECKPOINTS_ON_SIGTERM = (
    "\"$M27_PYTHON\" -c 'import pathlib, signal, sys, time\n"
    "def save(*_):\n time.sleep(1); pathlib.Path(\"saved\").write_text(\"yes\"); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, save)\npathlib.Path(\"ready\").write_text(\"1\")\n"
    "time.sleep(300)'; echo the shell does not exec the program")


async def test_a_program_that_outlives_its_shell_gets_the_whole_grace_to_checkpoint(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    """The shell dies of SIGTERM at once; the program it started takes a second to write
    its checkpoint. The grace period is the group's, so it is not SIGKILLed meanwhile."""
    cmd = start_cmd(CHECKPOINTS_ON_SIGTERM)
    await send(bus, cmd)
    started = await watch.wait_for(events.TaskStarted, of(cmd))
    work = workdir(m27_home, cmd)
    await wait_file(work / "ready")
    await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                    grace_s=20, reason="preempted"))
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert (work / "saved").read_text() == "yes"
    assert "SIGKILL" not in exited.reason
    await wait_dead(started.pid, timeout=2)


async def test_what_a_step_leaves_behind_is_killed_when_it_exits(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    cmd = start_cmd("sleep 300 & echo $! > child.pid; exit 0")
    await send(bus, cmd)
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert exited.exit_code == 0
    child = int(await wait_file(workdir(m27_home, cmd) / "child.pid"))
    await wait_dead(child, timeout=2)


async def test_stopping_an_unknown_task_is_harmless(agent: ServiceProcess, bus: NatsBus,
                                                   watch: Watch) -> None:
    await send(bus, events.StopTask(at=time.time(), task_id="r-x/none", attempt=1))
    cmd = start_cmd("true")
    await send(bus, cmd)  # handled after the stop: the agent is still taking commands
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert exited.exit_code == 0


# ---------------------------------------------------------------- timeouts


async def test_a_step_that_outlives_its_timeout_is_stopped_with_cause_timeout(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    cmd = start_cmd("sleep 300 & echo $! > child.pid; sleep 300", timeout_s=1.0,
                    outputs=("never.txt",))
    await send(bus, cmd)
    started = await watch.wait_for(events.TaskStarted, of(cmd))
    child = int(await wait_file(workdir(m27_home, cmd) / "child.pid"))
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert exited.at - started.at >= 1.0
    assert (exited.exit_code, exited.signal) == (128 + signal.SIGTERM, signal.SIGTERM)
    assert (exited.cause, exited.reason) == ("timeout", "killed by SIGTERM: timed out after 1s")
    assert exited.missing_outputs == ()  # a stopped step does not vouch for its outputs
    await wait_dead(started.pid, timeout=2)
    await wait_dead(child, timeout=2)
    assert "task.timed_out" in Path(agent.log_path).read_text()


async def test_a_step_that_ends_before_its_timeout_is_not_stopped_later(
        agent: ServiceProcess, bus: NatsBus, watch: Watch) -> None:
    cmd = start_cmd("true", timeout_s=1.0)
    await send(bus, cmd)
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert (exited.exit_code, exited.cause, exited.reason) == (0, "exit", "exit code 0")
    assert exited.started_at is not None
    marker = start_cmd("true", run_id=cmd.run_id, step="marker")
    await asyncio.sleep(max(0.0, exited.started_at + 1.5 - time.time()))
    await send(bus, marker)  # handled after the moment the timeout would have fired
    await watch.wait_for(events.TaskExited, of(marker))
    assert len(watch.all(events.TaskExited, of(cmd))) == 1
    log = Path(agent.log_path).read_text()
    assert "task.timed_out" not in log
    assert "task.stopping" not in log


async def test_a_stop_before_the_timeout_keeps_cause_stopped(
        agent: ServiceProcess, bus: NatsBus, watch: Watch) -> None:
    """The timeout fires during the stop's grace (the group ignores SIGTERM): it changes
    neither the cause nor the grace."""
    cmd = start_cmd("trap '' TERM; sleep 300 & wait", timeout_s=1.0)
    await send(bus, cmd)
    started = await watch.wait_for(events.TaskStarted, of(cmd))
    await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                    grace_s=1.5, reason="cancelled"))
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert exited.at - started.at >= 1.5
    assert (exited.signal, exited.cause) == (signal.SIGKILL, "stopped")
    assert exited.reason == "killed by SIGKILL: stopped: cancelled (SIGKILL after 1.5s grace)"
    assert "task.timed_out" not in Path(agent.log_path).read_text()
    await wait_dead(started.pid, timeout=2)


# ---------------------------------------------------------------- declared outputs


async def test_outputs_that_a_successful_step_did_not_make_are_reported_missing(
        agent: ServiceProcess, bus: NatsBus, watch: Watch) -> None:
    cmd = start_cmd("echo x > made.txt; mkdir dir_out",
                    outputs=("made.txt", "missing.txt", "dir_out"))
    await send(bus, cmd)
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert (exited.exit_code, exited.cause) == (0, "exit"), exited.stderr_tail
    assert exited.missing_outputs == ("missing.txt",)


async def test_outputs_are_looked_for_in_the_given_workdir_or_where_they_point(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, tmp_path: Path) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    made, gone = elsewhere / "abs.txt", elsewhere / "gone.txt"
    cmd = start_cmd(f"mkdir -p out && touch out/rel.txt {made}", workdir=str(work),
                    outputs=("out/rel.txt", str(made), "rel-gone.txt", str(gone)))
    await send(bus, cmd)
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert exited.exit_code == 0, exited.stderr_tail
    assert exited.missing_outputs == ("rel-gone.txt", str(gone))


async def test_a_failed_step_reports_no_missing_outputs(agent: ServiceProcess, bus: NatsBus,
                                                        watch: Watch) -> None:
    cmd = start_cmd("touch made.txt; exit 3", outputs=("made.txt", "missing.txt"))
    await send(bus, cmd)
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert (exited.exit_code, exited.cause, exited.missing_outputs) == (3, "exit", ())


# ---------------------------------------------------------------- at most once


async def test_a_duplicate_start_runs_the_step_once(agent: ServiceProcess, bus: NatsBus,
                                                    watch: Watch, m27_home: Path) -> None:
    cmd = start_cmd("echo ran >> runs.txt")
    older = start_cmd("echo old >> runs.txt", run_id=cmd.run_id, attempt=0)
    marker = start_cmd("true", run_id=cmd.run_id, step="marker")
    for command in (cmd, cmd, older, marker):
        await send(bus, command)
    await watch.wait_for(events.TaskExited, of(marker))  # commands are handled in order
    assert (workdir(m27_home, cmd) / "runs.txt").read_text() == "ran\n"
    assert len(watch.all(events.TaskStarted, of(cmd))) == 1
    assert len(watch.all(events.TaskExited, of(cmd))) == 1
    assert not watch.all(events.TaskStarted, of(older))


async def test_a_newer_attempt_replaces_one_still_running(agent: ServiceProcess, bus: NatsBus,
                                                          watch: Watch) -> None:
    first = start_cmd("sleep 300")
    second = start_cmd("true", run_id=first.run_id, attempt=2)
    await send(bus, first)
    await watch.wait_for(events.TaskStarted, of(first))
    await send(bus, second)
    old = await watch.wait_for(events.TaskExited, of(first))
    new = await watch.wait_for(events.TaskExited, of(second))
    assert old.reason == "killed by SIGTERM: superseded by attempt 2"
    assert old.cause == "superseded"
    assert (new.exit_code, new.cause) == (0, "exit")


# ---------------------------------------------------------------- the agent's own life


async def test_sigterm_stops_running_tasks_then_reports_the_node_stopped(
        agent: ServiceProcess, bus: NatsBus, watch: Watch) -> None:
    cmd = start_cmd("sleep 300")
    other = start_cmd("sleep 300", run_id=cmd.run_id, step="s2", timeout_s=300.0)
    for command in (cmd, other):
        await send(bus, command)
    started = await watch.wait_for(events.TaskStarted, of(cmd))
    other_started = await watch.wait_for(events.TaskStarted, of(other))
    os.kill(agent.pid, signal.SIGTERM)
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    other_exited = await watch.wait_for(events.TaskExited, of(other))
    for event in (exited, other_exited):
        assert (event.signal, event.cause) == (signal.SIGTERM, "node_stopped")
        assert event.reason == "killed by SIGTERM: node agent stopped"
    stopped = await watch.wait_for(events.NodeStopped)
    assert watch.seen.index(exited) < watch.seen.index(stopped)
    assert watch.seen.index(other_exited) < watch.seen.index(stopped)
    await wait_dead(other_started.pid, timeout=2)
    found = await bus.kv_get(subjects.NODES_BUCKET, NODE, NodeInfo)
    assert found is not None
    assert found[0].state == "stopped"
    await wait_dead(started.pid, timeout=2)
    await wait_dead(agent.pid, timeout=10)


async def test_a_restarted_agent_kills_and_reports_what_a_crashed_one_left_running(
        start_service: Any, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    crashed = start_service("node_agent", *AGENT_ARGS, name="agent-1")
    cmd = start_cmd("sleep 300 & echo $! > child.pid; sleep 300")
    await send(bus, cmd)
    started = await watch.wait_for(events.TaskStarted, of(cmd))
    child = int(await wait_file(workdir(m27_home, cmd) / "child.pid"))
    os.kill(crashed.pid, signal.SIGKILL)
    await wait_dead(crashed.pid)
    assert pid_alive(started.pid), "a step outlives its agent (own session)"
    start_service("node_agent", *AGENT_ARGS, name="agent-2")
    exited = await watch.wait_for(events.TaskExited, of(cmd))
    assert (exited.exit_code, exited.signal) == (137, signal.SIGKILL)
    assert exited.cause == "agent_restarted"
    assert "restarted" in exited.reason
    await wait_dead(started.pid, timeout=2)
    await wait_dead(child, timeout=2)
    marker = start_cmd("true", run_id=cmd.run_id, step="marker")
    await send(bus, cmd)  # a late redelivery must not run it again
    await send(bus, marker)
    await watch.wait_for(events.TaskExited, of(marker))
    assert len(watch.all(events.TaskStarted, of(cmd))) == 1


def test_an_invalid_node_id_is_one_clear_line(nats_url: str, m27_home: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "m27.node_agent", "--nats", nats_url, "--node-id", "bad.id"],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert "invalid node id 'bad.id'" in lines[-1]
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- checkpoint, pause, resume

SIGNAL_COUNTER = ("trap 'echo ckpt >> signals.txt' USR1; trap 'echo hup >> signals.txt' HUP; "
                  "echo $$ > shell.pid; i=0; while [ $i -lt 300 ]; do sleep 0.1; "
                  "i=$((i+1)); echo $i > ticks.txt; done")


async def ticks(path: Path) -> int:
    for _ in range(20):
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            await asyncio.sleep(0.05)
    raise AssertionError(f"{path} unreadable")


async def test_checkpoint_now_sends_the_steps_signal_and_pause_stops_the_clock(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    cmd = start_cmd(SIGNAL_COUNTER, checkpoint_signal="SIGHUP")
    await send(bus, cmd)
    await watch.wait_for(events.TaskStarted, of(cmd))
    work = workdir(m27_home, cmd)
    await wait_file(work / "ticks.txt")
    await send(bus, events.CheckpointTask(at=time.time(), task_id=cmd.task_id, attempt=1))
    assert (await wait_file(work / "signals.txt")).split() == ["hup"]
    await send(bus, events.PauseTask(at=time.time(), task_id=cmd.task_id, attempt=1))
    await asyncio.sleep(0.5)
    frozen = await ticks(work / "ticks.txt")
    await asyncio.sleep(0.8)
    assert await ticks(work / "ticks.txt") == frozen  # SIGSTOP: not a tick more
    beat = await watch.wait_for(events.NodeHeartbeat,
                                lambda b: any(t.paused for t in b.tasks), timeout=5)
    assert [t.task_id for t in beat.tasks if t.paused] == [cmd.task_id]
    await send(bus, events.ResumeTask(at=time.time(), task_id=cmd.task_id, attempt=1))
    await asyncio.sleep(0.6)
    assert await ticks(work / "ticks.txt") > frozen
    await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                    grace_s=1))
    await watch.wait_for(events.TaskExited, of(cmd))


async def test_the_checkpoint_interval_becomes_periodic_requests(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    cmd = start_cmd(SIGNAL_COUNTER, checkpoint_interval_s=0.4)
    await send(bus, cmd)
    await watch.wait_for(events.TaskStarted, of(cmd))
    work = workdir(m27_home, cmd)
    deadline = time.monotonic() + 10
    while not (work / "signals.txt").exists() or \
            len((work / "signals.txt").read_text().split()) < 3:
        assert time.monotonic() < deadline, "no periodic checkpoint requests"
        await asyncio.sleep(0.1)
    assert set((work / "signals.txt").read_text().split()) == {"ckpt"}
    await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                    grace_s=1))
    await watch.wait_for(events.TaskExited, of(cmd))


PROGRAM_COUNTS_SIGNALS = (
    "\"$M27_PYTHON\" -c 'import pathlib, signal, time\n"
    "got = []\n"
    "signal.signal(signal.SIGUSR1, lambda *_: got.append(1))\n"
    "while len(got) < 3: time.sleep(0.05)\n"
    "pathlib.Path(\"got.txt\").write_text(str(len(got)))'")


async def test_a_program_under_the_steps_shell_gets_its_checkpoint_signals_and_the_shell_lives(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    """Debian's sh does not exec the command, and the signal goes to the whole group: the
    shell must live through it (before the fix it died at the first request, exit 138)."""
    cmd = start_cmd(PROGRAM_COUNTS_SIGNALS, checkpoint_interval_s=0.3)
    await send(bus, cmd)
    exited = await watch.wait_for(events.TaskExited, of(cmd), timeout=20)
    assert (exited.cause, exited.exit_code, exited.signal) == ("exit", 0, None)
    assert (workdir(m27_home, cmd) / "got.txt").read_text() == "3"


async def test_a_step_with_checkpoint_signal_none_is_never_signalled(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    cmd = start_cmd(SIGNAL_COUNTER, checkpoint_interval_s=0.3, checkpoint_signal="none")
    await send(bus, cmd)
    await watch.wait_for(events.TaskStarted, of(cmd))
    work = workdir(m27_home, cmd)
    await wait_file(work / "ticks.txt")
    await send(bus, events.CheckpointTask(at=time.time(), task_id=cmd.task_id, attempt=1))
    await asyncio.sleep(1.5)  # five intervals and a request
    assert not (work / "signals.txt").exists()
    first = await ticks(work / "ticks.txt")
    await asyncio.sleep(0.3)
    assert await ticks(work / "ticks.txt") > first  # alive and working
    await send(bus, events.StopTask(at=time.time(), task_id=cmd.task_id, attempt=1,
                                    grace_s=1))
    await watch.wait_for(events.TaskExited, of(cmd))


async def test_multi_gpu_steps_get_nccl_defaults_and_shares_get_a_memory_fraction(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    both = start_cmd("env | grep -E '^(NCCL|TORCH_NCCL|M27_GPU_MEMORY_FRACTION|M27_PHASE)' "
                     "| sort > env.txt", step_type="gpu", gpu_ids=(0, 1), gpu_share=1.0,
                     env={"NCCL_DEBUG": "INFO"})
    await send(bus, both)
    await watch.wait_for(events.TaskExited, of(both))
    seen = dict(line.split("=", 1) for line in
                (workdir(m27_home, both) / "env.txt").read_text().splitlines())
    assert seen["NCCL_DEBUG"] == "INFO"  # the step's own setting wins
    assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert seen["M27_GPU_MEMORY_FRACTION"] == "1"
    assert seen["M27_PHASE_FILE"].endswith(f"/phases/{both.step}.1")
    half = start_cmd("echo $M27_GPU_MEMORY_FRACTION ${NCCL_DEBUG:-none} > f.txt",
                     run_id=both.run_id, step="half", step_type="gpu_light", gpu_ids=(1,),
                     gpu_share=0.5)
    await send(bus, half)
    await watch.wait_for(events.TaskExited, of(half))
    assert (workdir(m27_home, half) / "f.txt").read_text().split() == ["0.5", "none"]


async def test_a_start_without_its_fencing_token_is_not_run(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    unassigned = start_cmd("touch ran.txt")
    await send(bus, unassigned, fence=False)
    elsewhere = start_cmd("touch ran.txt", run_id=unassigned.run_id, step="elsewhere")
    await assign(bus, elsewhere.task_id, 1, "another-node")
    await send(bus, elsewhere, fence=False)
    marker = start_cmd("true", run_id=unassigned.run_id, step="marker")
    await send(bus, marker)
    await watch.wait_for(events.TaskExited, of(marker))
    assert not (workdir(m27_home, unassigned) / "ran.txt").exists()
    assert not watch.all(events.TaskStarted, of(unassigned))
    assert not watch.all(events.TaskStarted, of(elsewhere))


async def test_an_agent_kills_its_task_once_the_task_is_assigned_elsewhere(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    cmd = start_cmd("echo $$ > pid.txt; sleep 120")
    await send(bus, cmd)
    await watch.wait_for(events.TaskStarted, of(cmd))
    pid = int(await wait_file(workdir(m27_home, cmd) / "pid.txt"))
    await assign(bus, cmd.task_id, 2, "replacement")  # as after this node was declared lost
    exited = await watch.wait_for(events.TaskExited, of(cmd), timeout=10)
    assert exited.cause == "fenced"
    assert "attempt 1 is stale: attempt 2 is assigned to replacement" in exited.reason
    await wait_dead(pid)


async def test_gpu_memory_left_behind_by_an_ended_task_is_reported_and_cleaned(
        agent: ServiceProcess, bus: NatsBus, watch: Watch, m27_home: Path) -> None:
    """A process that escaped its task's group (setsid) and still holds (simulated) GPU
    memory after the task ended is a leak: reported, and killed since it is provably ours."""
    cmd = start_cmd('setsid "$M27_PYTHON" -c "import time; x = bytearray(40 << 20); '
                    'x[::4096] = b\\"1\\" * len(x[::4096]); time.sleep(300)" & '
                    'echo $! > orphan.pid; sleep 1', step_type="gpu_light", gpu_ids=(1,),
                    gpu_share=0.5)
    await send(bus, cmd)
    orphan = int(await wait_file(workdir(m27_home, cmd) / "orphan.pid"))
    await watch.wait_for(events.TaskExited, of(cmd))
    assert pid_alive(orphan)  # it left the group: killing the group did not reach it
    leak = await watch.wait_for(events.GpuMemoryLeak, lambda e: e.task_id == cmd.task_id,
                                timeout=20)
    assert (leak.gpu_index, leak.cleaned, leak.node_id) == (1, True, NODE)
    assert orphan in leak.pids
    await wait_dead(orphan)
