"""The agent's lease renewals: a failed one is tried again at once, and nothing else the
heartbeat does (the stale-attempt check's fence reads) can hold them up."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from m27.common import subjects
from m27.common.config import NodeSection
from m27.common.memory_bus import MemoryBus
from m27.common.model import GpuInfo, NodeInfo
from m27.node_agent._backends import SimulatedGpus
from m27.node_agent.service import NodeAgent

GPU = GpuInfo(index=0, name="m27 simulated GPU", uuid="SIM-0", memory_total_mb=1024,
              simulated=True)


class FlakyKv(MemoryBus):
    """KV writes to the nodes bucket fail while `refusing` (a JetStream election)."""

    def __init__(self) -> None:
        super().__init__()
        self.refusing = 0
        self.renewed = asyncio.Event()

    async def kv_put(self, bucket: str, key: str, value: msgspec.Struct) -> int:
        if bucket == subjects.NODES_BUCKET and self.refusing > 0:
            self.refusing -= 1
            raise TimeoutError("no response from stream")
        revision = await super().kv_put(bucket, key, value)
        if bucket == subjects.NODES_BUCKET:
            self.renewed.set()
        return revision


def agent(bus: MemoryBus, tmp_path: Path, heartbeat_s: float) -> NodeAgent:
    settings = NodeSection(heartbeat_interval=heartbeat_s, lease_fence_after=10.0)
    node = NodeAgent(bus, node_id="n1", backend=SimulatedGpus((GPU,), "n1"),  # type: ignore[arg-type]
                     settings=settings, stop=asyncio.Event(), home=tmp_path, environ={})
    node._info = NodeInfo(node_id="n1", hostname="h", backend="simulated", gpus=(GPU,),
                          cpu_slots=1, registered_at=0.0, last_heartbeat=0.0, seq=1)
    return node


async def test_a_failed_renewal_is_tried_again_well_within_the_interval(
        tmp_path: Path) -> None:
    """With a 30 s heartbeat, a refused renewal is not left for 30 s (the lease lapses after
    10): the retry comes within a second."""
    bus = FlakyKv()
    bus.refusing = 2
    node = agent(bus, tmp_path, heartbeat_s=30.0)
    loop = asyncio.create_task(node._heartbeat_loop())
    try:
        started = time.monotonic()
        await asyncio.wait_for(bus.renewed.wait(), 5.0)
        assert time.monotonic() - started < 5.0
        assert node.lease.renewals == 1
        assert bus.refusing == 0
    finally:
        node._heartbeats_stop.set()
        await loop


async def test_a_hanging_stale_check_does_not_hold_up_the_renewals(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bus = FlakyKv()
    node = agent(bus, tmp_path, heartbeat_s=0.05)
    hanging = asyncio.Event()

    async def fence_read_that_hangs() -> int:
        hanging.set()
        await asyncio.Event().wait()
        return 0

    monkeypatch.setattr(node.runner, "kill_stale", fence_read_that_hangs)
    loops = [asyncio.create_task(node._heartbeat_loop()),
             asyncio.create_task(node._stale_loop())]
    try:
        await asyncio.wait_for(hanging.wait(), 5.0)
        before = node.lease.renewals
        while node.lease.renewals < before + 5:  # renewals go on while it hangs
            bus.renewed.clear()
            await asyncio.wait_for(bus.renewed.wait(), 5.0)
    finally:
        node._heartbeats_stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), 5.0)
