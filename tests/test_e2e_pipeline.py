"""End to end: pipelines submitted over gRPC run on real services, processes and NATS."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import nats
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from nats.aio.msg import Msg

from m27.common import subjects
from m27.embedded.nats_server import pid_alive
from m27.v1 import pipeline_pb2 as pb
from m27.v1 import pipeline_pb2_grpc as pb_grpc
from tests.support import Cluster

pytestmark = pytest.mark.integration

SEED_HARMLESS = """\
pipeline:
  - name: preprocessing
    type: cpu
    command: sleep 0.3; echo "prepared from {{INPUT_FILE}}" > prep.txt
    output: prep.txt
  - name: md_simulation
    type: gpu
    depends_on: [preprocessing]
    checkpoint: 300s
    command: test -f prep.txt && echo "gpus=$CUDA_VISIBLE_DEVICES" > md.txt && sleep 0.3
  - name: analysis
    type: gpu_light
    depends_on: [md_simulation]
    command: cat md.txt; echo "share=$M27_GPU_SHARE backend=$M27_GPU_BACKEND"
"""


class EventLog:
    """A plain NATS subscriber, as any user's client would be: JSON off the wire."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, object]]] = []

    async def handle(self, msg: Msg) -> None:
        self.items.append((msg.subject, json.loads(msg.data)))

    def of_run(self, run_id: str) -> list[dict[str, object]]:
        return [data for _, data in self.items if data.get("run_id") == run_id]


@pytest.fixture
async def event_log(cluster: Cluster) -> AsyncIterator[EventLog]:
    log = EventLog()
    nc = await nats.connect(cluster.nats_url)
    await nc.subscribe(subjects.EVENTS_ALL, cb=log.handle)
    await nc.flush()
    yield log
    await nc.close()


@pytest.fixture
async def stub(cluster: Cluster) -> AsyncIterator[pb_grpc.PipelineServiceAsyncStub]:
    async with cluster.access.channel(cluster.api) as channel:
        yield pb_grpc.PipelineServiceStub(channel)


async def wait_final(stub: pb_grpc.PipelineServiceAsyncStub, run_id: str,
                     timeout: float = 60.0) -> pb.Run:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = await stub.GetRun(pb.GetRunRequest(run_id=run_id))
        if run.state in (pb.RUN_STATE_SUCCEEDED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED):
            return run
        await asyncio.sleep(0.1)
    raise AssertionError(f"run {run_id} did not finish: {run}")


async def wait_step_state(stub: pb_grpc.PipelineServiceAsyncStub, run_id: str, step: str,
                          state: int, timeout: float = 20.0) -> None:
    """Until the orchestrator's record (not just the process) shows the step in `state`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = await stub.GetRun(pb.GetRunRequest(run_id=run_id))
        if any(s.name == step and s.state == state for s in run.steps):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"step {step} of {run_id} never reached state {state}")


async def wait_for(predicate: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_seed_pipeline_runs_in_dependency_order_with_an_event_per_change(
        cluster: Cluster, stub: pb_grpc.PipelineServiceAsyncStub, event_log: EventLog,
        tmp_path: Path) -> None:
    reply = await stub.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml=SEED_HARMLESS, vars={"INPUT_FILE": "1abc.pdb; rm -rf /"},
        user="ada", urgency=pb.URGENCY_HIGH, workdir=str(tmp_path), source_name="seed.yaml"))
    run = await wait_final(stub, reply.run_id)
    assert run.state == pb.RUN_STATE_SUCCEEDED, cluster.logs()
    steps = {s.name: s for s in run.steps}
    assert list(steps) == ["preprocessing", "md_simulation", "analysis"]
    assert all(s.state == pb.STEP_STATE_SUCCEEDED and s.exit_code == 0 for s in run.steps)
    assert steps["preprocessing"].ended_at <= steps["md_simulation"].started_at
    assert steps["md_simulation"].ended_at <= steps["analysis"].started_at
    assert (tmp_path / "prep.txt").read_text() == "prepared from 1abc.pdb; rm -rf /\n"
    assert steps["md_simulation"].gpu_share == 1.0
    assert steps["md_simulation"].gpu_simulated
    assert "backend=simulated" in steps["analysis"].stdout_tail
    assert "share=0.5" in steps["analysis"].stdout_tail
    assert steps["analysis"].node_id == "node-1"

    await wait_for(lambda: any(e["type"] == "report_ready"
                               for e in event_log.of_run(reply.run_id)))
    changes = [(e["step"], e["previous"], e["state"]) for e in event_log.of_run(reply.run_id)
               if e["type"] == "step_state_changed"]
    for name in steps:
        assert [c[1:] for c in changes if c[0] == name] == [
            ("pending", "queued"), ("queued", "running"), ("running", "succeeded")]
    types = [e["type"] for e in event_log.of_run(reply.run_id)]
    assert types[0] == "run_submitted"
    assert "run_state_changed" in types
    report = next(e for e in event_log.of_run(reply.run_id) if e["type"] == "report_ready")
    html = Path(str(report["path"])).read_text()
    assert all(name in html for name in steps)
    final = await stub.GetRun(pb.GetRunRequest(run_id=reply.run_id))
    assert final.report_path == report["path"]


async def test_a_failing_step_fails_the_run_with_exit_code_and_stderr(
        stub: pb_grpc.PipelineServiceAsyncStub, tmp_path: Path) -> None:
    text = """pipeline:
  - {name: ok, type: cpu, command: "echo fine"}
  - {name: broken, type: cpu, depends_on: [ok], command: "echo 'disk on fire' >&2; exit 3"}
  - {name: after, type: gpu, depends_on: [broken], command: "echo never"}
"""
    reply = await stub.SubmitPipeline(pb.SubmitPipelineRequest(pipeline_yaml=text,
                                                               workdir=str(tmp_path)))
    run = await wait_final(stub, reply.run_id)
    assert run.state == pb.RUN_STATE_FAILED
    steps = {s.name: s for s in run.steps}
    assert steps["broken"].state == pb.STEP_STATE_FAILED
    assert steps["broken"].exit_code == 3
    assert "disk on fire" in steps["broken"].stderr_tail
    assert steps["after"].state == pb.STEP_STATE_SKIPPED
    assert "broken" in run.reason


async def test_cancel_kills_the_whole_process_group_of_a_running_step(
        stub: pb_grpc.PipelineServiceAsyncStub, tmp_path: Path) -> None:
    text = """pipeline:
  - name: long
    type: gpu
    command: "sleep 300 & echo $! > child.pid; echo $$ > shell.pid; sleep 300"
  - {name: later, type: cpu, depends_on: [long], command: "echo never"}
"""
    reply = await stub.SubmitPipeline(pb.SubmitPipelineRequest(pipeline_yaml=text,
                                                               workdir=str(tmp_path)))
    await wait_for(lambda: (tmp_path / "child.pid").exists() and (tmp_path / "shell.pid")
                   .exists())
    await wait_step_state(stub, reply.run_id, "long", pb.STEP_STATE_RUNNING)
    pids = [int((tmp_path / f).read_text()) for f in ("child.pid", "shell.pid")]
    assert all(pid_alive(pid) for pid in pids)
    cancelled = await stub.CancelRun(pb.CancelRunRequest(run_id=reply.run_id, reason="test"))
    assert cancelled.state == pb.RUN_STATE_RUNNING
    run = await wait_final(stub, reply.run_id)
    assert run.state == pb.RUN_STATE_CANCELLED
    assert [s.state for s in run.steps] == [pb.STEP_STATE_CANCELLED, pb.STEP_STATE_CANCELLED]
    await wait_for(lambda: not any(pid_alive(pid) for pid in pids), timeout=15)



async def test_watch_streams_snapshot_then_events_and_ends_after_the_final_one(
        stub: pb_grpc.PipelineServiceAsyncStub, tmp_path: Path) -> None:
    text = "pipeline:\n  - {name: a, command: 'sleep 0.5'}\n  - {name: b, command: 'true', " \
           "depends_on: [a]}\n"
    reply = await stub.SubmitPipeline(pb.SubmitPipelineRequest(pipeline_yaml=text,
                                                               workdir=str(tmp_path)))
    items = [item async for item in stub.WatchRun(pb.WatchRunRequest(run_id=reply.run_id))]
    assert items[0].HasField("snapshot")
    assert items[0].snapshot.run_id == reply.run_id
    last = items[-1].event
    assert (last.type, last.state) == ("run_state_changed", "succeeded")
    seen = {(i.event.step, i.event.state) for i in items[1:] if i.event.step}
    assert ("b", "succeeded") in seen
    # Watching a finished run: just the snapshot, then the stream ends.
    again = [i async for i in stub.WatchRun(pb.WatchRunRequest(run_id=reply.run_id))]
    assert len(again) == 1
    assert again[0].snapshot.state == pb.RUN_STATE_SUCCEEDED


async def test_bad_requests_get_clear_statuses(stub: pb_grpc.PipelineServiceAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitPipeline(pb.SubmitPipelineRequest(
            pipeline_yaml="pipeline:\n  - {name: a, command: x, depends_on: [b]}\n",
            source_name="bad.yaml"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bad.yaml:2:" in (info.value.details() or "")
    assert "unknown step `b`" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetRun(pb.GetRunRequest(run_id="r-20000101-000000-000000"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetRun(pb.GetRunRequest(run_id="../../etc/passwd"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitPipeline(pb.SubmitPipelineRequest(
            pipeline_yaml="pipeline:\n  - {name: a, command: x}\n", workdir="relative/dir"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_list_runs_newest_first(stub: pb_grpc.PipelineServiceAsyncStub) -> None:
    reply = await stub.ListRuns(pb.ListRunsRequest(limit=100))
    ids = [r.run_id for r in reply.runs]
    assert ids == sorted(ids, reverse=True)
    assert len(ids) >= 3


async def test_every_service_serves_health_and_reflection(cluster: Cluster) -> None:
    for name, proc in cluster.processes.items():
        access = cluster.access_as("orchestrator", "node") if name.startswith("node-agent") \
            else cluster.access
        async with access.channel(proc.grpc_address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.SERVING, name
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            services = [s.name async for r in stream for s in r.list_services_response.service]
            assert "grpc.health.v1.Health" in services, name
            if name == "orchestrator":
                assert "m27.v1.PipelineService" in services
