"""What the scheduling end-to-end tests share: a system whose agents are started by the test
(simulated GPUs, enough CPU slots), the scheduler's API, waits, and small step programs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Final, TypeVar

from m27.client import Client
from m27.client.scheduler import QueueItem, SchedulerClient
from m27.common import subjects
from m27.common.bus import NatsBus
from m27.common.model import ServiceInfo, StepRecord
from m27.embedded.processes import ServiceProcess, wait_ready
from tests.support import Cluster, lines, service_log

#: Preemption may hit a task after 1 s (not 5 min), a stop gets 20 s to checkpoint.
FAST_POLICY: Final = {"M27_SCHEDULER_MIN_RUNTIME": "1s", "M27_SCHEDULER_PREEMPT_GRACE": "20s",
                      "M27_SCHEDULER_TICK": "0.5s"}

#: Counts to N, one step every 0.1 s, appending "<attempt> <i>" to NAME.log; on SIGTERM it
#: saves the step it is at into NAME.state (checkpoint-then-stop) and exits 143; a later
#: attempt starts after the saved step.
COUNTER: Final = '''\
import os, pathlib, signal, sys, time
name, total = sys.argv[1], int(sys.argv[2])
hold = int(sys.argv[3]) if len(sys.argv) > 3 else -1  # attempt 1 waits there to be stopped
state = pathlib.Path(f"{name}.state")
i = int(state.read_text()) if state.exists() else 0
attempt = os.environ.get("M27_ATTEMPT", "-")
print(f"attempt {attempt} resumes at {i}", flush=True)
def checkpoint_and_stop(signum, frame):
    state.write_text(str(i))
    with open(f"{name}.log", "a") as log:
        log.write(f"{attempt} checkpoint {i}\\n")
    sys.exit(143)
signal.signal(signal.SIGTERM, checkpoint_and_stop)
while i < total:
    time.sleep(0.1)
    if attempt == "1" and i == hold:
        continue
    i += 1
    with open(f"{name}.log", "a") as log:
        log.write(f"{attempt} {i} {time.time():.3f}\\n")
state.write_text(str(i))
'''


def start_agent(cluster: Cluster, node: str, gpus: str = "sim:1") -> ServiceProcess:
    proc = cluster.launch(f"agent-{node}", "m27.node_agent",
                          ["--node-id", node, "--instance", node, "--gpus", gpus,
                           "--cpu-slots", "8", "--heartbeat-interval", "1s"])
    wait_ready([proc])
    return proc


def agent_system(tmp_path: Path, *nodes: str,
                 env: Mapping[str, str] = FAST_POLICY) -> Iterator[Cluster]:
    """A whole system whose node-agents (one simulated GPU each) are the named ones, for a
    fixture to `yield from`; stopped afterwards."""
    cluster = Cluster(tmp_path / "system", nodes=0, env=dict(env))
    cluster.start()
    for node in nodes:
        start_agent(cluster, node)
    yield cluster
    cluster.stop()


def scheduler_address(cluster: Cluster) -> str:
    return cluster.processes["scheduler"].grpc_address


async def queue(cluster: Cluster, explain: bool = False) -> list[QueueItem]:
    async with SchedulerClient(scheduler_address(cluster), access=cluster.access) as scheduler:
        return await scheduler.queue(explain=explain)


T = TypeVar("T")


async def poll_queue(cluster: Cluster, found: Callable[[list[QueueItem]], T | None],
                     what: str, *, explain: bool = False, timeout: float = 30.0) -> T:
    """The first non-empty `found(queue)`, asked of one client every 0.1 s; an assertion
    naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    async with SchedulerClient(scheduler_address(cluster), access=cluster.access) as scheduler:
        while True:
            result = found(await scheduler.queue(explain=explain))
            if result:
                return result
            assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"
            await asyncio.sleep(0.1)


def m27_cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """The `m27` command against this system (API and scheduler given explicitly)."""
    env = {**cluster.env, "M27_API": cluster.api, "M27_SCHEDULER": scheduler_address(cluster)}
    return subprocess.run([sys.executable, "-m", "m27.cli", *args], env=env, text=True,
                          capture_output=True, timeout=60, check=False)


async def step_of(client: Client, run_id: str, name: str) -> StepRecord:
    step = (await client.get_run(run_id)).step(name)
    assert step is not None
    return step


async def wait_step(client: Client, run_id: str, name: str,
                    check: Callable[[StepRecord], bool], what: str,
                    timeout: float = 60.0) -> StepRecord:
    deadline = time.monotonic() + timeout
    while True:
        step = await step_of(client, run_id, name)
        if check(step):
            return step
        assert time.monotonic() < deadline, f"{what}: {step}"
        await asyncio.sleep(0.1)


def counts(path: Path, attempt: int) -> list[int]:
    """The steps an attempt of COUNTER logged, in order."""
    return [int(parts[1]) for parts in (line.split() for line in lines(path))
            if parts[0] == str(attempt) and parts[1] != "checkpoint"]


def scheduler_log(cluster: Cluster) -> str:
    return service_log(cluster.processes["scheduler"])


async def scheduler_metrics(cluster: Cluster) -> str:
    """A scrape of the scheduler's /metrics, found where it registered (KV m27_services)."""
    bus = await NatsBus.open(cluster.nats_url, name="test-metrics")
    try:
        keys = [k for k in await bus.kv_keys(subjects.SERVICES_BUCKET)
                if k.startswith("scheduler.")]
        assert len(keys) == 1, keys
        got = await bus.kv_get(subjects.SERVICES_BUCKET, keys[0], ServiceInfo)
    finally:
        await bus.close()
    assert got is not None
    address = got[0].metrics_address
    assert address, "the scheduler registered no metrics address"
    url = f"http://{address}/metrics"
    return await asyncio.to_thread(
        lambda: urllib.request.urlopen(url, timeout=5).read().decode())
