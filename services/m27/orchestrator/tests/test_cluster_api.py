"""The cluster view's decisions: node liveness, GPU readings and shares, CPU bookings, and
which attempt's logs a request means."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest

from m27.client._cluster import node_from_proto
from m27.common import subjects
from m27.common.api_auth import ApiAccess, ephemeral_keys
from m27.common.errors import NotFoundError
from m27.common.events import EnqueueTask
from m27.common.grpc_server import start_server
from m27.common.memory_bus import MemoryBus
from m27.common.model import (
    AttemptRecord,
    GpuInfo,
    GpuSample,
    NodeInfo,
    Resources,
    RunRecord,
    ServiceInfo,
    StepRecord,
    TaskHolding,
)
from m27.orchestrator.cluster_api import (
    ClusterServicer,
    Found,
    Refusal,
    _TaskEntry,
    cpus_booked,
    find_attempt,
    logs_request,
    node_state,
    node_to_proto,
    share_of_each,
)
from m27.orchestrator.runs import StoredRun
from m27.scheduler._state import Placement, TaskEntry
from m27.v1 import cluster_pb2 as pb
from m27.v1 import cluster_pb2_grpc as pb_grpc

KEYS = ephemeral_keys()
ADMIN = ApiAccess(token=KEYS.mint(user="tester", role="admin", ttl_s=0))


RUN = "r-20261201-000000-abcdef"
GPUS = tuple(GpuInfo(index=i, name="m27 simulated GPU", uuid=f"SIM-{i}",
                     memory_total_mb=16384, simulated=True) for i in range(2))


def node(**changes: Any) -> NodeInfo:
    fields: dict[str, Any] = {
        "node_id": "node-1", "hostname": "h", "backend": "simulated", "gpus": GPUS,
        "cpu_slots": 8, "registered_at": 0.0, "last_heartbeat": 100.0,
    }
    fields.update(changes)
    return NodeInfo(**fields)


@pytest.mark.parametrize(("changes", "now", "expected"), [
    ({}, 101.0, "up"),
    ({}, 115.0, "up"),
    ({}, 115.5, "lost"),
    ({"state": "stopped"}, 101.0, "stopped"),
    ({"state": "stopped"}, 500.0, "stopped"),
])
def test_a_node_is_lost_once_its_heartbeat_is_older_than_the_timeout(
        changes: dict[str, Any], now: float, expected: str) -> None:
    assert node_state(node(**changes), now, node_timeout=15.0) == expected


@pytest.mark.parametrize(("gpu_ids", "share", "each"), [
    ((), 0.0, 0.0), ((0,), 0.5, 0.5), ((0,), 0.0, 1.0), ((0, 1), 2.0, 1.0), ((1,), 1.0, 1.0),
])
def test_the_share_of_each_gpu(gpu_ids: tuple[int, ...], share: float, each: float) -> None:
    holding = TaskHolding(task_id=f"{RUN}/t", attempt=1, gpu_ids=gpu_ids, gpu_share=share)
    assert share_of_each(holding) == each


def test_a_node_shows_each_gpus_latest_reading_and_who_holds_it() -> None:
    info = node(
        samples=(GpuSample(index=1, utilization_pct=37.0, memory_used_mb=4096,
                           temperature_c=51.0, power_w=120.0, power_limit_w=300.0,
                           memory_total_mb=16384, throttle=("thermal",), simulated=True),),
        holdings=(TaskHolding(task_id=f"{RUN}/train", attempt=2, gpu_ids=(1,),
                              gpu_share=0.5, paused=True),
                  TaskHolding(task_id=f"{RUN}/prep", attempt=1)),
        incarnation="abc", cgroups=True)
    message = node_to_proto(info, now=102.5, node_timeout=15.0, cpu_used=3)
    assert (message.state, message.heartbeat_age_s, message.cpu_used, message.cpu_slots,
            message.backend, message.incarnation, message.cgroups) == \
        ("up", 2.5, 3, 8, "simulated", "abc", True)
    idle, busy = message.gpus
    assert (idle.index, idle.simulated, idle.memory_total_mb, list(idle.holdings)) == \
        (0, True, 16384, [])
    assert (busy.utilization_pct, busy.memory_used_mb, busy.temperature_c, busy.power_w,
            busy.power_limit_w, list(busy.throttle)) == (37.0, 4096, 51.0, 120.0, 300.0,
                                                         ["thermal"])
    assert list(busy.holdings) == [pb.Holding(task_id=f"{RUN}/train", attempt=2, share=0.5,
                                              paused=True)]


def test_what_the_client_gets_back_keeps_the_simulated_flag_and_unknown_power() -> None:
    info = node(samples=(GpuSample(index=0, utilization_pct=5.0, memory_used_mb=1,
                                   temperature_c=30.0),))
    status = node_from_proto(node_to_proto(info, now=100.0, node_timeout=15.0, cpu_used=0))
    assert [g.simulated for g in status.gpus] == [True, True]
    assert (status.gpus[0].power_w, status.gpus[0].power_limit_w) == (None, None)


def test_cpu_bookings_are_read_from_the_schedulers_own_entries() -> None:
    task = EnqueueTask(at=0.0, task_id=f"{RUN}/a", run_id=RUN, step="a", attempt=1,
                       step_type="cpu", resources=Resources(cpus=3),
                       urgency="normal", user="ada", command="true")
    def on(node_id: str, cpus: int) -> TaskEntry:
        return TaskEntry(task=task, queued_at=0.0, placement=Placement(
            task_id=task.task_id, attempt=1, node_id=node_id, gpu_ids=(0,), gpu_milli=500,
            cpus=cpus), started=True)

    placed, other = on("node-1", 3), on("node-2", 1)
    queued = TaskEntry(task=task, queued_at=0.0)
    decoded = [msgspec.json.decode(msgspec.json.encode(e), type=_TaskEntry)
               for e in (placed, placed, other, queued)]
    assert cpus_booked(decoded) == {"node-1": 6, "node-2": 1}


def step(**changes: Any) -> StepRecord:
    fields: dict[str, Any] = {"name": "train", "type": "gpu", "command": "x"}
    fields.update(changes)
    return StepRecord(**fields)


def run_with(*steps: StepRecord) -> RunRecord:
    return RunRecord(run_id=RUN, name="study", user="ada", urgency="normal",
                     state="running", created_at=0.0, steps=steps)


def ran(attempt: int, node_id: str, started: float | None = 1.0) -> AttemptRecord:
    return AttemptRecord(attempt=attempt, node_id=node_id, started_at=started, ended_at=2.0,
                         exit_code=1, cause="exit", reason="exit code 1")


RUNNING = step(state="running", attempt=2, node_id="node-2", history=(ran(1, "node-1"),))
RETRYING = step(state="retrying", attempt=2, node_id="node-1", history=(ran(1, "node-1"),))
CACHED = step(state="succeeded", attempt=1, cached_from="r-20261130-000000-000001/train")
NEVER = step(state="failed", attempt=1, reason="could not start: no such GPU",
             history=(ran(1, "node-1", started=None),))


@pytest.mark.parametrize(("record", "attempt", "expected"), [
    (RUNNING, 0, Found(attempt=2, node_id="node-2")),
    (RUNNING, 1, Found(attempt=1, node_id="node-1")),
    (RETRYING, 0, Found(attempt=1, node_id="node-1")),
    (step(state="succeeded", attempt=1, node_id="node-1", history=(ran(1, "node-1"),)), 0,
     Found(attempt=1, node_id="node-1")),
])
def test_the_attempt_asked_for_and_where_it_ran(record: StepRecord, attempt: int,
                                                expected: Found) -> None:
    assert find_attempt(run_with(record), "train", attempt) == expected


@pytest.mark.parametrize(("record", "name", "attempt", "code", "message", "waitable"), [
    (RUNNING, "trian", 0, "not_found",
     f"run {RUN} has no step 'trian' (did you mean `train`?)", False),
    (RUNNING, "zzz", 0, "not_found", f"run {RUN} has no step 'zzz' (its steps: train)", False),
    (RUNNING, "train", 3, "not_found",
     "step train has no attempt 3 (attempts that ran: 1, 2)", False),
    (RETRYING, "train", 2, "failed_precondition",
     "attempt 2 of step train has no logs: it has not started yet (retrying)", True),
    (step(state="pending"), "train", 0, "failed_precondition",
     "step train has no logs: it has not started yet (pending)", True),
    (step(state="queued", attempt=1), "train", 0, "failed_precondition",
     "attempt 1 of step train has no logs: it has not started yet (queued)", True),
    (NEVER, "train", 0, "failed_precondition",
     "attempt 1 of step train has no logs: it never ran (failed: could not start: no such "
     "GPU)", False),
    (CACHED, "train", 0, "not_found",
     "step train did not run: it reused the results of r-20261130-000000-000001/train (see "
     "`m27 logs r-20261130-000000-000001 train`)", False),
])
def test_why_there_are_no_logs(record: StepRecord, name: str, attempt: int, code: str,
                               message: str, waitable: bool) -> None:
    assert find_attempt(run_with(record), name, attempt) == Refusal(
        code=code, message=message, waitable=waitable)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "message"), [
    ({"run_id": "nope"}, "not a run id"),
    ({"step": "a/b"}, "not a step name"),
    ({"attempt": -1}, "attempt must be 1 or more"),
    ({"tail_bytes": -5}, "must not be negative"),
    ({"stream": "both"}, ""),
])
def test_log_requests_are_checked(fields: dict[str, Any], message: str) -> None:
    request = pb.StreamLogsRequest(run_id=RUN, step="train")
    for name, value in fields.items():
        setattr(request, name, value)
    if not message:
        assert logs_request(request).streams == ("stdout", "stderr")
        return
    with pytest.raises(ValueError, match=message):
        logs_request(request)


# ---------------------------------------------------------------- the relay, with fakes


def agent_registered(address: str) -> MemoryBus:
    """An in-memory bus whose services bucket holds node-1's agent at `address`."""
    bus = MemoryBus()
    info = ServiceInfo(name="node-agent", instance="node-1", grpc_address=address, pid=1,
                       host="h", started_at=0.0)
    bus.kv[(subjects.SERVICES_BUCKET, "node-agent.node-1")] = (msgspec.json.encode(info), 1)
    return bus


class FakeStore:
    def __init__(self, bus: MemoryBus, run: RunRecord) -> None:
        self.bus = bus
        self.run = run

    async def get(self, run_id: str) -> tuple[StoredRun, int]:
        if run_id != self.run.run_id:
            raise NotFoundError(run_id)
        return StoredRun(run=self.run), 1


class DyingAgent(pb_grpc.NodeServiceServicer):
    """Sends the first bytes of stdout, then goes away mid-stream."""

    async def TailLog(self, request: pb.TailLogRequest,
                      context: Any) -> AsyncIterator[pb.LogChunk]:
        yield pb.LogChunk(stream="stdout", data=b"hel", offset=0)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "agent going down")


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[pb_grpc.ClusterServiceAsyncStub]:
    agent = await start_server("127.0.0.1:0", [lambda s: pb_grpc.add_NodeServiceServicer_to_server(
        DyingAgent(), s)], [], keys=KEYS)
    finished = step(state="succeeded", attempt=1, node_id="node-1",
                    history=(ran(1, "node-1"),))
    store = FakeStore(agent_registered(agent.address), run_with(finished))
    servicer = ClusterServicer(store, node_timeout=15.0, home=tmp_path,  # type: ignore[arg-type]
                               agents=ApiAccess(token=lambda: KEYS.mint(user="orchestrator",
                                                                        role="node")),
                               poll_s=0.01)
    api = await start_server("127.0.0.1:0", [servicer.register], [], keys=KEYS)
    async with ADMIN.channel(api.address) as channel:
        yield pb_grpc.ClusterServiceStub(channel)
    await api.stop(0)
    await agent.stop(0)


async def test_a_relay_cut_off_mid_stream_goes_on_from_the_local_files_where_it_stopped(
        relay: pb_grpc.ClusterServiceAsyncStub, tmp_path: Path) -> None:
    logs = tmp_path / "runs" / RUN / "logs"
    logs.mkdir(parents=True)
    (logs / "train.1.out").write_bytes(b"hello\n")
    (logs / "train.1.err").write_bytes(b"warn\n")
    chunks = [c async for c in relay.StreamLogs(pb.StreamLogsRequest(run_id=RUN,
                                                                     step="train"))]
    assert [(c.stream, c.data, c.offset) for c in chunks] == [
        ("stdout", b"hel", 0), ("stdout", b"lo\n", 3), ("stderr", b"warn\n", 0)]


async def test_a_relay_without_the_agent_or_local_files_is_unavailable_naming_the_node(
        relay: pb_grpc.ClusterServiceAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [c async for c in relay.StreamLogs(pb.StreamLogsRequest(run_id=RUN, step="train"))]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    details = info.value.details() or ""
    assert details.startswith("the node-agent of node-1 at 127.0.0.1:")
    assert details.endswith("they are on node node-1")
