"""The telemetry shell: samples in, events out (with msg ids), tasks stopped, leaks cleaned.

A scripted backend stands in for NVML (no GPU is here); the simulated backend runs on real
processes, and leaked-process cleanup kills a real orphan.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from m27.common import events, subjects
from m27.common.memory_bus import MemoryBus
from m27.common.model import GpuBackend, GpuInfo, GpuProcess, GpuSample, TaskHolding
from m27.node_agent._backends import SimulatedGpus
from m27.node_agent._gpus import GpuSpec, Holding, simulated_gpus
from m27.node_agent._telemetry import (
    TELEMETRY_KEEP,
    Publish,
    RunningView,
    Telemetry,
    TelemetrySettings,
    kill_leaked,
    read_phase,
)

GPU = GpuInfo(index=0, name="NVIDIA A100", uuid="GPU-0", memory_total_mb=10000,
              simulated=False)


class Scripted:
    """A backend whose next readings the test sets."""

    kind: GpuBackend = "nvml"
    gpus = (GPU,)

    def __init__(self) -> None:
        self.next: list[GpuSample] = []
        self.fail = False
        self.holdings: list[Sequence[Holding]] = []

    def set(self, util: float, *procs: GpuProcess, energy_j: float | None = None) -> None:
        self.next = [GpuSample(index=0, utilization_pct=util,
                               memory_used_mb=sum(p.memory_mb for p in procs),
                               temperature_c=50, power_w=100.0, memory_total_mb=10000,
                               energy_j=energy_j, processes=procs)]

    def sample(self, holdings: Sequence[Holding], now: float) -> tuple[GpuSample, ...]:
        self.holdings.append(holdings)
        if self.fail:
            raise RuntimeError("GPU is lost")
        return tuple(self.next)

    def task_utilization(self) -> Mapping[tuple[str, int], float]:
        return {}

    def unmeasured(self) -> Mapping[int, frozenset[str]]:
        return {}

    def close(self) -> None:
        return None


class Stops:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    async def __call__(self, task_id: str, attempt: int, note: str) -> None:
        self.calls.append((task_id, attempt, note))


def view(**kw: object) -> RunningView:
    base: dict[str, object] = {"task_id": "r1/train", "run_id": "r1", "step": "train",
                               "attempt": 1, "gpu_ids": (0,), "gpu_share": 0.5, "pgid": 4242}
    base.update(kw)
    return RunningView(**base)  # type: ignore[arg-type]


def publish_to(bus: MemoryBus) -> Publish:
    """The agent's publish callable (positional msg_id), onto the in-memory bus."""
    async def publish(subject: str, event: events.Message, msg_id: str) -> None:
        await bus.publish(subject, event, msg_id=msg_id)
    return publish


def telemetry(backend: object, bus: MemoryBus, stops: Stops, node: str = "n1",
              **settings: object) -> Telemetry:
    config = TelemetrySettings(**{"idle_samples": 2, "over_share_samples": 2,
                                  **settings})  # type: ignore[arg-type]
    return Telemetry(backend, node, config, publish_to(bus), stops,  # type: ignore[arg-type]
                     hostname="host-1")


def mine(memory_mb: int, task_id: str = "r1/train", attempt: int = 1,
         pid: int = 4242) -> GpuProcess:
    return GpuProcess(pid=pid, memory_mb=memory_mb, task_id=task_id, attempt=attempt)


async def test_an_idle_task_is_announced_once_and_busy_again_once() -> None:
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops)
    for util in (3, 3, 3, 80, 80):
        backend.set(util)
        await tel.tick([view()], now=float(len(bus.published)))
    [(subject, idle, idle_id), (_, busy, busy_id)] = bus.published
    assert subject == subjects.task_events("r1", "train", subjects.node_sender("n1"))
    assert isinstance(idle, events.TaskIdle)
    assert (idle.idle_share, idle.gpu_ids, idle.reason, idle.node_id) == (
        0.5, (0,), "gpu_idle", "n1")
    assert isinstance(busy, events.TaskBusy)
    assert busy.utilization_pct == 80
    assert idle_id != busy_id
    assert idle_id is not None
    assert idle_id.startswith("r1/train:1:idle:")
    assert backend.holdings[0] == [Holding(gpu_ids=(0,), gpu_share=0.5, task_id="r1/train",
                                           attempt=1, pgid=4242)]


async def test_a_reported_io_phase_is_idle_at_once(tmp_path: Path) -> None:
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops)
    phase = tmp_path / "phases" / "train.1"
    phase.parent.mkdir()
    backend.set(95)
    await tel.tick([view(phase_file=str(phase))], now=1.0)  # no file yet: compute
    phase.write_text("io\n")
    await tel.tick([view(phase_file=str(phase))], now=2.0)
    phase.write_text("compute")
    await tel.tick([view(phase_file=str(phase))], now=3.0)
    assert [type(e).__name__ for _, e, _ in bus.published] == ["TaskIdle", "TaskBusy"]
    assert bus.of(events.TaskIdle)[0].reason == "io_phase"


@pytest.mark.parametrize(("content", "expected"), [
    ("io", "io"), ("IO\n", "io"), (" compute ", "compute"), ("loading", ""), ("", ""),
])
def test_read_phase(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "phase"
    path.write_text(content)
    assert read_phase(str(path)) == expected


def test_read_phase_never_blocks_on_a_fifo_or_fails_on_a_missing_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_phase(str(fifo)) == ""
    assert read_phase(str(tmp_path / "nothing")) == ""
    assert read_phase("") == ""


@pytest.mark.parametrize(("policy", "stopped"), [("stop", True), ("warn", False)])
async def test_a_task_over_its_share_is_warned_then_stopped_per_policy(
        policy: str, stopped: bool) -> None:
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops, over_share=policy)
    for now in (1.0, 2.0, 3.0):
        backend.set(90, mine(6000))  # half of 10000 MB is 5000
        await tel.tick([view()], now=now)
    actions = [e.action for e in bus.of(events.TaskOverShare)]
    assert actions == (["warned", "stopped"] if stopped else ["warned"])
    assert [(t, a) for t, a, _ in stops.calls] == ([("r1/train", 1)] if stopped else [])
    if stopped:
        assert "6000 MB" in stops.calls[0][2]
        over = bus.of(events.TaskOverShare)[1]
        assert (over.used_mb, over.limit_mb, over.gpu_index) == (
            6000, 5000, 0)


async def test_overprovision_and_an_explicit_request_set_the_limit() -> None:
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops, memory_overprovision=1.5)
    backend.set(90, mine(6000))
    await tel.tick([view()], now=1.0)  # 6000 < 5000 x 1.5
    assert bus.published == []
    await tel.tick([view(gpu_memory_mb=3000)], now=2.0)  # 6000 > 3000 x 1.5
    assert [e.limit_mb for e in bus.of(events.TaskOverShare)] == [4500]


async def test_samples_between_heartbeats_decide_idle_but_nothing_else() -> None:
    """`watch_idle` counts towards idle like a heartbeat's sample; over-share and leaks are
    judged only at heartbeats (`tick`), so their confirmation keeps the heartbeat's pace."""
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops)  # 2 samples: idle, 2 samples over: stopped
    backend.set(0, mine(9000))  # idle, and far over its 5000 MiB share
    await tel.watch_idle([view()], now=1.0)
    await tel.watch_idle([view()], now=2.0)
    assert [type(e).__name__ for _, e, _ in bus.published] == ["TaskIdle"]
    assert tel.samples[0].memory_used_mb == 9000  # what the next heartbeat carries
    await tel.tick([view()], now=5.0)  # the first heartbeat sample over: warned only
    assert [e.action for e in bus.of(events.TaskOverShare)] == ["warned"]
    assert stops.calls == []
    await tel.tick([view()], now=10.0)
    assert [e.action for e in bus.of(events.TaskOverShare)] == ["warned", "stopped"]
    assert len(stops.calls) == 1


async def test_energy_is_accounted_per_task_until_it_is_forgotten() -> None:
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops)
    for now, joules in ((0.0, 1000.0), (5.0, 1600.0), (10.0, 2000.0)):
        backend.set(90, energy_j=joules)
        await tel.tick([view()], now=now)
    assert tel.energy_j("r1/train", 1) == pytest.approx(0.5 * 1000)
    assert tel.energy_j("r1/cpu", 1) is None
    assert 'm27_task_energy_joules{task_id="r1/train"' in tel.metrics_text()
    tel.forget("r1/train", 1)
    assert tel.energy_j("r1/train", 1) is None


async def test_events_the_bus_did_not_take_are_sent_next_tick_with_the_same_ids() -> None:
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops, idle_samples=1)
    bus.fail_with = TimeoutError("nats: timeout")
    backend.set(0)
    await tel.tick([view()], now=1.0)
    assert bus.published == []
    bus.fail_with = None
    backend.set(50)
    await tel.tick([view()], now=2.0)
    assert [type(e).__name__ for _, e, _ in bus.published] == ["TaskIdle", "TaskBusy"]  # in order
    assert bus.published[0][2] == "r1/train:1:idle:1.000"


async def test_heartbeat_readings_reach_the_telemetry_stream_after_an_outage() -> None:
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops, idle_samples=1)
    holding = TaskHolding(task_id="r1/train", attempt=1, gpu_ids=(0,), gpu_share=0.5)
    backend.set(50)
    bus.fail_with = TimeoutError("nats: timeout")
    samples = await tel.tick([view()], now=1.0)
    for seq in range(TELEMETRY_KEEP + 5):  # more than it keeps while the bus is away
        tel.record(float(seq), "inc-1", seq, samples, [holding])
        await tel.tick([view()], now=2.0 + seq)
    assert bus.published == []
    assert tel.readings_dropped == 5
    bus.fail_with = None
    await tel.tick([view()], now=10_000.0)
    sent = [(s, e, i) for s, e, i in bus.published if isinstance(e, events.GpuTelemetry)]
    assert [e.seq for _, e, _ in sent] == list(range(5, TELEMETRY_KEEP + 5))  # the newest
    subject, first, msg_id = sent[0]
    assert subject == subjects.telemetry(subjects.node_sender("n1"))
    assert msg_id == "n1:inc-1:5:telemetry"
    assert (first.node_id, first.backend, first.tasks) == ("n1", "nvml", (holding,))
    assert first.gpus == samples


async def test_a_failed_sample_gives_no_readings_and_no_decisions() -> None:
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops, idle_samples=1)
    backend.fail = True
    assert await tel.tick([view()], now=1.0) == ()
    assert bus.published == []


# ---------------------------------------------------------------- leaks, with real processes


def orphan(node: str, task_id: str = "r1/old", attempt: int = 1) -> subprocess.Popen[bytes]:
    env = {**os.environ, "M27_TASK_ID": task_id, "M27_ATTEMPT": str(attempt),
           "M27_NODE_ID": node, "M27_GPU_IDS": "0"}
    return subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)


@pytest.mark.parametrize("ended_here", [True, False])
async def test_memory_held_after_a_task_ended_is_reported_and_cleaned_when_safe(
        ended_here: bool) -> None:
    node = f"t-{uuid.uuid4().hex[:8]}"
    backend, bus, stops = Scripted(), MemoryBus(), Stops()
    tel = telemetry(backend, bus, stops, node=node)
    left = orphan(node)
    try:
        await asyncio.sleep(0.05)  # let it exec, so its environment is readable
        if ended_here:
            tel.forget("r1/old", 1)
        for now in (1.0, 2.0, 3.0):
            backend.set(0, mine(700, "r1/old", 1, pid=left.pid))
            await tel.tick([], now=now)
        [(subject, leak, _)] = bus.published
        assert subject == subjects.node_events(node)
        assert isinstance(leak, events.GpuMemoryLeak)
        assert (leak.task_id, leak.pids, leak.memory_mb, leak.cleaned) == (
            "r1/old", (left.pid,), 700, ended_here)
        if ended_here:
            assert left.wait(timeout=5) == -9
        else:
            assert left.poll() is None
    finally:
        left.kill()
        left.wait()


def test_kill_leaked_checks_each_pid_is_still_the_tasks() -> None:
    node = f"t-{uuid.uuid4().hex[:8]}"
    left = orphan(node)
    try:
        time.sleep(0.05)
        assert kill_leaked([left.pid, 1, os.getpid()], ("r1/other", 1), node) == 0
        assert kill_leaked([left.pid], ("r1/old", 1), "another-node") == 0
        assert left.poll() is None
        assert kill_leaked([left.pid, 1, os.getpid()], ("r1/old", 1), node) == 1
        assert left.wait(timeout=5) == -9
    finally:
        left.kill()
        left.wait()


# ---------------------------------------------------------------- the simulated backend


BUSY = [sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"]


def start(argv: list[str], node: str, task_id: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "M27_TASK_ID": task_id, "M27_ATTEMPT": "1", "M27_NODE_ID": node,
           "M27_GPU_IDS": "0"}
    return subprocess.Popen(argv, env=env, start_new_session=True)


@pytest.mark.timeout(30)
async def test_simulated_gpus_show_a_busy_task_busy_and_a_sleeping_one_idle() -> None:
    node = f"t-{uuid.uuid4().hex[:8]}"
    gpus = simulated_gpus(node, GpuSpec(mode="sim", count=2, memory_mb=16384))
    bus, stops = MemoryBus(), Stops()
    tel = telemetry(SimulatedGpus(gpus, node), bus, stops, node=node, idle_samples=2,
                    over_share="warn")
    busy = start(BUSY, node, "r1/busy")
    asleep = start(["sleep", "30"], node, "r1/io")
    try:
        views = [view(task_id="r1/busy", step="busy", gpu_ids=(0,), gpu_share=0.5,
                      pgid=busy.pid),
                 view(task_id="r1/io", step="io", gpu_ids=(1,), gpu_share=0.5,
                      pgid=asleep.pid)]
        samples: tuple[GpuSample, ...] = ()
        for i in range(3):
            samples = await tel.tick(views, now=time.time())
            await asyncio.sleep(0.5 if i < 2 else 0)
        # How much CPU the busy one gets depends on the machine's load, so only the order
        # is asserted; a sleeping process uses none however loaded the machine is.
        assert samples[0].utilization_pct > samples[1].utilization_pct
        assert samples[1].utilization_pct < 5
        assert all(s.simulated for s in samples)
        assert {p.pid for p in samples[0].processes} == {busy.pid}
        assert samples[0].memory_used_mb >= 1  # the interpreter's resident memory
        [idle] = bus.of(events.TaskIdle)
        assert idle.task_id == "r1/io"
        assert 'm27_simulated="true"' in tel.metrics_text()
    finally:
        for proc in (busy, asleep):
            proc.kill()
            proc.wait()
