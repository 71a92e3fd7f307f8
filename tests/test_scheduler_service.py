"""The scheduler service with real node-agents: it notices nodes at once, and frees capacity."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import msgspec
import pytest

from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.common.model import GpuInfo, NodeInfo
from m27.embedded.processes import wait_ready
from tests.support import Cluster

pytestmark = pytest.mark.integration


async def test_a_node_that_registers_after_the_scheduler_gets_work_at_once(
        tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes=0)
    cluster.start()
    try:
        async with cluster.client() as client:
            run_id = await client.submit("pipeline:\n  - {name: a, type: gpu, command: 'true'}\n")
            await asyncio.sleep(1.0)
            assert (await client.get_run(run_id)).state == "queued"
            agent = cluster.launch("node-agent-1", "m27.node_agent",
                                   ["--node-id", "late", "--gpus", "sim:1",
                                    "--heartbeat-interval", "8s"])
            wait_ready([agent])
            began = time.monotonic()
            while (await client.get_run(run_id)).state != "succeeded":
                assert time.monotonic() - began < 4.0, "waited for a heartbeat to schedule"
                await asyncio.sleep(0.05)
            assert (await client.get_run(run_id)).steps[0].node_id == "late"
    finally:
        cluster.stop()


async def test_a_scheduler_started_after_the_nodes_uses_them_at_once(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes=0)
    cluster.nats.start()
    try:
        started = [cluster.launch("orchestrator", "m27.orchestrator"),
                   cluster.launch("node-agent-1", "m27.node_agent",
                                  ["--node-id", "early", "--gpus", "sim:1",
                                   "--heartbeat-interval", "8s"])]
        wait_ready(started)
        await asyncio.sleep(0.5)  # its first heartbeat is gone; the next is 8 s away
        wait_ready([cluster.launch("scheduler", "m27.scheduler")])
        async with cluster.client() as client:
            run_id = await client.submit("pipeline:\n  - {name: a, type: gpu, command: 'true'}\n")
            began = time.monotonic()
            while (await client.get_run(run_id)).state != "succeeded":
                assert time.monotonic() - began < 3.0, "the registered node was not used"
                await asyncio.sleep(0.05)
    finally:
        cluster.stop()


async def test_gpu_steps_wait_for_a_free_gpu_and_then_run(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, gpus="sim:1")
    cluster.start()
    try:
        text = ("pipeline:\n" + "".join(
            f"  - {{name: g{i}, type: gpu, command: 'sleep 0.3'}}\n" for i in range(3)))
        async with cluster.client() as client:
            run_id = await client.submit(text)
            deadline = time.monotonic() + 30
            while (run := await client.get_run(run_id)).state != "succeeded":
                assert time.monotonic() < deadline, run
                running = [s for s in run.steps if s.state == "running"]
                assert len(running) <= 1, "two whole-GPU steps shared one GPU"
                await asyncio.sleep(0.02)
            spans = sorted((s.started_at or 0, s.ended_at or 0) for s in run.steps)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    finally:
        cluster.stop()


async def test_a_task_placed_on_a_node_that_stopped_before_starting_it_runs_elsewhere(
        tmp_path: Path) -> None:
    """A node that shuts down right after the scheduler placed a task on it never reads
    that StartTask. Once the node's record says stopped, the task is released and retried
    on a live node. (The test plays the departed agent: it writes the records one leaves.)"""
    cluster = Cluster(tmp_path, nodes=0)
    cluster.start()
    bus = await NatsBus.open(cluster.nats_url, name="test")
    try:
        now = time.time()
        gpu = GpuInfo(index=0, name="sim", uuid="GPU-gone-0", memory_total_mb=16000,
                      simulated=True)
        gone = NodeInfo(node_id="gone", hostname="gone", backend="simulated", gpus=(gpu,),
                        cpu_slots=4, registered_at=now, last_heartbeat=now,
                        incarnation="i1", seq=1)
        await bus.kv_put(subjects.NODES_BUCKET, "gone", gone)
        await bus.publish(subjects.node_events("gone"), events.NodeRegistered(
            at=now, node_id="gone", hostname="gone", backend="simulated", gpus=(gpu,),
            cpu_slots=4))
        async with cluster.client() as client:
            run_id = await client.submit("pipeline:\n  - {name: a, type: gpu, command: 'true'}\n")
            deadline = time.monotonic() + 10
            while (await client.get_run(run_id)).steps[0].node_id != "gone":
                assert time.monotonic() < deadline, "never placed on the node"
                await asyncio.sleep(0.05)
            await bus.kv_put(subjects.NODES_BUCKET, "gone", msgspec.structs.replace(
                gone, state="stopped", seq=2))
            await bus.publish(subjects.node_events("gone"), events.NodeStopped(
                at=time.time(), node_id="gone", reason="shut down"))
            wait_ready([cluster.launch("node-agent-1", "m27.node_agent",
                                       ["--node-id", "live", "--gpus", "sim:1",
                                        "--heartbeat-interval", "1s"])])
            deadline = time.monotonic() + 30
            while (run := await client.get_run(run_id)).state != "succeeded":
                assert time.monotonic() < deadline, f"not run elsewhere: {run}"
                await asyncio.sleep(0.1)
            step = run.steps[0]
            assert (step.node_id, step.attempt) == ("live", 2)
            assert (step.history[0].node_id, step.history[0].cause) == ("gone", "node_stopped")
    finally:
        await bus.close()
        cluster.stop()
