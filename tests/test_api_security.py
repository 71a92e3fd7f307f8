"""The authenticated API (issue 14, point 2), attacked on a running system: anonymous and
wrong-token calls to every service, a user acting on another's run, claiming another user
or an urgency above their level, a user doing an admin's work, a step's token used for
another task. Each must fail with UNAUTHENTICATED or PERMISSION_DENIED and do nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from m27.common import tokens
from m27.common.api_auth import ApiAccess
from m27.v1 import (
    checkpoint_pb2,
    checkpoint_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from m27.v1 import pipeline_pb2 as pb
from m27.v1 import pipeline_pb2_grpc as pb_grpc
from tests.support import Cluster, finished_run

pytestmark = pytest.mark.integration

Code = grpc.StatusCode
LONG = "pipeline:\n  - {name: a, command: 'sleep 60'}\n"
QUICK = "pipeline:\n  - {name: a, command: 'true'}\n"


@pytest.fixture(scope="module", params=["loopback", "tls"])
def lab(tmp_path_factory: pytest.TempPathFactory,
        request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Every attack on loopback (local credentials) and again with mutual TLS on every
    server: the tokens and roles are checked whatever carries the call."""
    system = Cluster(tmp_path_factory.mktemp("lab"),
                     env={"M27_SCHEDULER_USER_LEVELS": "carol:pi"},
                     api_tls=request.param == "tls")
    system.start()
    yield system
    system.stop()


async def refused(call: Awaitable[Any] | AsyncIterator[Any]) -> tuple[Code, str]:
    """The status a call ends with (it must fail)."""
    try:
        if hasattr(call, "__aiter__"):  # a streaming call
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    raise AssertionError("the call succeeded")


def pipeline(lab: Cluster, access: ApiAccess) -> pb_grpc.PipelineServiceAsyncStub:
    return pb_grpc.PipelineServiceStub(access.channel(lab.api))


def address(lab: Cluster, name: str) -> str:
    return lab.processes[name].grpc_address


def every_service_call(lab: Cluster, channel_for: Any) -> list[tuple[str, Any]]:
    """One call to each service's own API (the report service: reflection)."""
    orchestrator = channel_for(address(lab, "orchestrator"))
    scheduler = channel_for(address(lab, "scheduler"))
    store = channel_for(address(lab, "checkpoint-store"))
    agent = channel_for(address(lab, "node-agent-1"))
    report = channel_for(address(lab, "report"))
    reflect = reflection_pb2.ServerReflectionRequest(list_services="")
    return [
        ("ListRuns", pb_grpc.PipelineServiceStub(orchestrator).ListRuns(pb.ListRunsRequest())),
        ("CancelRun", pb_grpc.PipelineServiceStub(orchestrator).CancelRun(
            pb.CancelRunRequest(run_id="r-20261201-081500-a1b2c3"))),
        ("ListNodes", cluster_pb2_grpc.ClusterServiceStub(orchestrator).ListNodes(
            cluster_pb2.ListNodesRequest())),
        ("SetNodeMaintenance", scheduler_pb2_grpc.SchedulerServiceStub(scheduler)
         .SetNodeMaintenance(scheduler_pb2.SetNodeMaintenanceRequest(
             node_id="node-1", action="cordon"))),
        ("Delete", checkpoint_pb2_grpc.CheckpointServiceStub(store).Delete(
            checkpoint_pb2.DeleteRequest(task_id="r-20261201-081500-a1b2c3/a",
                                         checkpoint_id="c-0000000000001-000000"))),
        ("TailLog", cluster_pb2_grpc.NodeServiceStub(agent).TailLog(
            cluster_pb2.TailLogRequest(task_id="r-20261201-081500-a1b2c3/a", attempt=1))),
        ("reflection", reflection_pb2_grpc.ServerReflectionStub(report)
         .ServerReflectionInfo(iter([reflect]))),
    ]


async def test_anonymous_calls_reach_no_service_but_health_answers(lab: Cluster) -> None:
    """A plain connection with no token: every service refuses every call; probes still
    see SERVING; nothing was cordoned."""
    channels: list[grpc.aio.Channel] = []

    def plain(target: str) -> grpc.aio.Channel:
        channels.append(lab.bare_channel(target))
        return channels[-1]

    for name, call in every_service_call(lab, plain):
        code, details = await refused(call)
        assert code == Code.UNAUTHENTICATED, (name, details)
        assert "needs a token" in details
    for channel in channels:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        await channel.close(None)
    async with lab.access.channel(address(lab, "scheduler")) as channel:
        held = await scheduler_pb2_grpc.SchedulerServiceStub(channel).ListNodeMaintenance(
            scheduler_pb2.ListNodeMaintenanceRequest())
    assert all(n.state == "" for n in held.nodes)


@pytest.mark.parametrize("forged", ["garbage", "foreign", "expired", "node-admin",
                                    "tampered"])
async def test_wrong_tokens_are_refused_everywhere(lab: Cluster, forged: str) -> None:
    assert lab.keys.control is not None
    now = time.time()
    if forged == "garbage":
        token = "m27t1.c.not.atoken"  # noqa: S105 - a forgery
    elif forged == "foreign":  # an admin token of another m27
        token = tokens.mint(os.urandom(32), "c", user="root", role="admin", now=now)
    elif forged == "expired":
        token = tokens.mint(lab.keys.control, "c", user="root", role="admin",
                            now=now - 120, ttl_s=60)
    elif forged == "node-admin":  # what a node (holding node.key only) could sign
        token = lab.keys.mint(user="node-1", role="node").replace(".n.", ".c.", 1)
    else:  # a user's token with its role rewritten
        user = lab.keys.mint(user="alice", role="user", ttl_s=0)
        head, kid, _claims, mac = user.split(".")
        admin = lab.keys.mint(user="alice", role="admin", ttl_s=0).split(".")[2]
        token = f"{head}.{kid}.{admin}.{mac}"
    access = lab.with_token(token)
    for name, call in every_service_call(lab, access.channel):
        code, details = await refused(call)
        assert code == Code.UNAUTHENTICATED, (forged, name, details)


async def test_a_user_can_neither_see_nor_change_another_users_run(lab: Cluster,
                                                                   tmp_path: Path) -> None:
    bob = pipeline(lab, lab.access_as("bob"))
    alice = pipeline(lab, lab.access_as("alice"))
    run_id = (await bob.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml=LONG, workdir=str(tmp_path)))).run_id
    mine = (await alice.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml=QUICK, workdir=str(tmp_path)))).run_id
    logs = cluster_pb2_grpc.ClusterServiceStub(lab.access_as("alice").channel(lab.api))
    attacks: dict[str, Any] = {
        "GetRun": alice.GetRun(pb.GetRunRequest(run_id=run_id)),
        "CancelRun": alice.CancelRun(pb.CancelRunRequest(run_id=run_id)),
        "CancelRun step": alice.CancelRun(pb.CancelRunRequest(run_id=run_id, step="a")),
        "RetryRun": alice.RetryRun(pb.RetryRunRequest(run_id=run_id)),
        "WatchRun": alice.WatchRun(pb.WatchRunRequest(run_id=run_id)),
        "WatchEvents": alice.WatchEvents(pb.WatchEventsRequest(run_id=run_id)),
        "StreamLogs": logs.StreamLogs(cluster_pb2.StreamLogsRequest(run_id=run_id, step="a")),
        "ListRuns bob": alice.ListRuns(pb.ListRunsRequest(user="bob")),
    }
    for name, call in attacks.items():
        code, details = await refused(call)
        assert code == Code.PERMISSION_DENIED, (name, details)
    listed = await alice.ListRuns(pb.ListRunsRequest(limit=100))
    assert {r.run_id for r in listed.runs} == {mine}
    assert {r.user for r in listed.runs} == {"alice"}
    seen = await bob.GetRun(pb.GetRunRequest(run_id=run_id))
    assert seen.state not in (pb.RUN_STATE_CANCELLED, pb.RUN_STATE_FAILED)
    # the owner may; so may an admin (who acts on anyone's runs)
    admin = pipeline(lab, lab.access)
    assert (await admin.GetRun(pb.GetRunRequest(run_id=run_id))).user == "bob"
    await admin.CancelRun(pb.CancelRunRequest(run_id=run_id, reason="admin"))


async def test_the_user_is_the_tokens_and_no_other(lab: Cluster, tmp_path: Path) -> None:
    alice = pipeline(lab, lab.access_as("alice"))
    code, details = await refused(alice.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml=QUICK, user="carol", workdir=str(tmp_path))))
    assert code == Code.PERMISSION_DENIED
    assert "you are alice" in details
    run_id = (await alice.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml=QUICK, workdir=str(tmp_path)))).run_id
    assert (await alice.GetRun(pb.GetRunRequest(run_id=run_id))).user == "alice"
    code, _ = await refused(alice.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml=QUICK, user="x" * 5000, workdir=str(tmp_path))))
    assert code == Code.INVALID_ARGUMENT


async def test_urgency_is_capped_by_the_users_level(lab: Cluster, tmp_path: Path) -> None:
    """alice (student, the default level) may ask for high, not urgent — neither in the
    request nor in the file; carol (pi in [scheduler] user_levels) may."""
    alice = pipeline(lab, lab.access_as("alice"))
    urgent_file = "priority: urgent\n" + QUICK
    for request in (pb.SubmitPipelineRequest(pipeline_yaml=QUICK, urgency=pb.URGENCY_URGENT,
                                             workdir=str(tmp_path)),
                    pb.SubmitPipelineRequest(pipeline_yaml=urgent_file,
                                             workdir=str(tmp_path))):
        code, details = await refused(alice.SubmitPipeline(request))
        assert code == Code.PERMISSION_DENIED, details
        assert "student" in details, details
    await alice.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml=QUICK, urgency=pb.URGENCY_HIGH, workdir=str(tmp_path)))
    carol = pipeline(lab, lab.access_as("carol"))
    await carol.SubmitPipeline(pb.SubmitPipelineRequest(pipeline_yaml=urgent_file,
                                                        workdir=str(tmp_path)))


async def test_cordon_and_checkpoint_deletion_are_for_admins(lab: Cluster) -> None:
    user = lab.access_as("alice")
    scheduler = scheduler_pb2_grpc.SchedulerServiceStub(user.channel(
        address(lab, "scheduler")))
    cordon = scheduler_pb2.SetNodeMaintenanceRequest(
        node_id="node-1", action="cordon")
    code, details = await refused(scheduler.SetNodeMaintenance(cordon))
    assert code == Code.PERMISSION_DENIED
    assert "admin" in details
    assert (await scheduler.ListQueue(scheduler_pb2.ListQueueRequest())) is not None
    store = checkpoint_pb2_grpc.CheckpointServiceStub(user.channel(
        address(lab, "checkpoint-store")))
    code, _ = await refused(store.Delete(checkpoint_pb2.DeleteRequest(
        task_id="r-20261201-081500-a1b2c3/a", checkpoint_id="c-0000000000001-000000")))
    assert code == Code.PERMISSION_DENIED
    step = lab.access_as("step-1", "step", task_id="r-20261201-081500-a1b2c3/a", attempt=1)
    code, _ = await refused(pipeline(lab, step).ListRuns(pb.ListRunsRequest()))
    assert code == Code.PERMISSION_DENIED  # a step's token is for checkpoints only
    admin = scheduler_pb2_grpc.SchedulerServiceStub(lab.access.channel(
        address(lab, "scheduler")))
    done = await admin.SetNodeMaintenance(cordon)
    assert done.state == "cordoned"
    await admin.SetNodeMaintenance(scheduler_pb2.SetNodeMaintenanceRequest(
        node_id="node-1", action="uncordon"))


async def test_a_step_gets_a_token_for_its_own_attempt_only(lab: Cluster,
                                                            tmp_path: Path) -> None:
    """The token a node-agent gives a step (in $M27_TOKEN) lets it write its own task's
    checkpoints, and is refused for another task's and for the runs API."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import os\n"
        "from m27.client.checkpoints import RemoteStore\n"
        "from m27.common.checkpoint_api import CheckpointStoreError\n"
        "store = RemoteStore(os.environ['M27_CHECKPOINT_STORE'])\n"
        "store.put_bytes(store.task_id, b'mine', attempt=store.attempt)\n"
        "try:\n"
        "    store.put_bytes(store.task_id + 'x', b'theirs', attempt=store.attempt)\n"
        "except CheckpointStoreError as exc:\n"
        "    print('refused:', exc)\n")
    alice = pipeline(lab, lab.access_as("alice"))
    run_id = (await alice.SubmitPipeline(pb.SubmitPipelineRequest(
        pipeline_yaml=f"pipeline:\n  - {{name: a, command: '{sys.executable} {script}'}}\n",
        workdir=str(tmp_path)))).run_id

    async with lab.client(lab.access_as("alice")) as client:
        run = await finished_run(client, run_id)
    out = (lab.home / "runs" / run_id / "logs" / "a.1.out").read_text()
    err = (lab.home / "runs" / run_id / "logs" / "a.1.err").read_text()
    assert run.state == "succeeded", err
    assert "refused:" in out, out + err
    assert "this step's token is for" in out, out + err


def test_a_token_made_by_the_admin_command_names_its_user(lab: Cluster,
                                                          tmp_path: Path) -> None:
    """`m27 api token create`: the file is the user's own; with it the CLI is that user."""
    env = {**lab.env, "M27_API": lab.api}
    token = tmp_path / "dave.token"
    made = subprocess.run([sys.executable, "-m", "m27.cli", "api", "token", "create",
                           "--user", "dave", "--out", str(token)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert token.stat().st_mode & 0o077 == 0
    pipeline_file = tmp_path / "p.yaml"
    pipeline_file.write_text(QUICK)
    as_dave = {**env, "M27_CLIENT_TOKEN_FILE": str(token)}
    submitted = subprocess.run([sys.executable, "-m", "m27.cli", "submit", str(pipeline_file),
                                "--urgency", "urgent"], env=as_dave, capture_output=True,
                               text=True, timeout=60)
    assert submitted.returncode == 1
    assert "urgency urgent is above what student users may ask for" in submitted.stderr
    assert "Traceback" not in submitted.stderr
    nobody = subprocess.run([sys.executable, "-m", "m27.cli", "runs"],
                            env={**env, "M27_TOKEN": "m27t1.c.bad.token"},
                            capture_output=True, text=True, timeout=60)
    assert nobody.returncode == 1, nobody.stderr
    assert "damaged" in nobody.stderr, nobody.stderr
