"""The Python client of the m27 API (`m27.v1.PipelineService`), returning domain structs.

    async with Client("127.0.0.1:50051") as client:
        run_id = await client.submit(Path("pipeline.yaml").read_text(), vars={"SEED": "1"})
        async for item in client.watch(run_id):
            ...

gRPC errors become `ClientError` (or its subclasses) with a message a person can act on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import TypeVar

import grpc
import msgspec
from grpc_health.v1 import health_pb2, health_pb2_grpc

from m27.client._cluster import (
    GpuStatus,
    NodeStatus,
    TaskShare,
    chunk_from_proto,
    from_cluster_service,
    node_from_proto,
)
from m27.common import events, proto
from m27.common.api_auth import ApiAccess, default_access
from m27.common.errors import M27Error, NotFoundError, Unavailable
from m27.common.grpc_server import CLIENT_OPTIONS
from m27.common.logfiles import LogChunk
from m27.common.model import RunRecord, RunState, Urgency
from m27.pipeline.plan import Plan
from m27.v1 import cluster_pb2, cluster_pb2_grpc
from m27.v1 import pipeline_pb2 as pb
from m27.v1 import pipeline_pb2_grpc as pb_grpc

Req = TypeVar("Req")
Resp = TypeVar("Resp")

__all__ = ["BusEvent", "Client", "ClientError", "GpuStatus", "LogChunk", "NodeStatus",
           "PipelineRejected", "RunEvent", "RunSummary", "TaskShare"]


class ClientError(M27Error):
    """The API could not be reached or refused the call."""


class PipelineRejected(ClientError):
    """The pipeline YAML has problems; the message lists every one of them."""


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    name: str
    user: str
    state: RunState
    created_at: float
    ended_at: float | None
    steps_total: int
    steps_succeeded: int
    steps_failed: int

    @classmethod
    def of(cls, run: RunRecord) -> RunSummary:
        """The summary of a whole run record, as ListRuns gives it."""
        return cls(run_id=run.run_id, name=run.name, user=run.user, state=run.state,
                   created_at=run.created_at, ended_at=run.ended_at,
                   steps_total=len(run.steps),
                   steps_succeeded=sum(s.state == "succeeded" for s in run.steps),
                   steps_failed=sum(s.state == "failed" for s in run.steps))


class RunEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One event of a watched run (see proto RunEvent)."""

    type: str
    at: float
    run_id: str
    step: str = ""
    state: str = ""
    previous: str = ""
    attempt: int = 0
    node_id: str = ""
    exit_code: int | None = None
    reason: str = ""
    report_path: str = ""
    final: bool = False
    sequence: int = 0  # position in the events stream: resume a watch after it


class BusEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One event of the events stream (`WatchEvents`), as it was published on NATS."""

    #: The event; None when this client does not know its type (a newer server's).
    event: events.Event | None
    event_json: str  # as published: a JSON object with its `type` and `at`
    subject: str
    sequence: int  # in the events stream
    stored_at: float


class Client:
    """An async connection to one orchestrator."""

    def __init__(self, address: str, *, access: ApiAccess | None = None,
                 timeout: float = 15.0) -> None:
        """`access`: the token (and TLS) to call with; default: this user's, from
        `$M27_TOKEN`, `[client] token_file` or the one `m27 up` wrote."""
        self.address = address
        self.timeout = timeout
        self._channel = (access or default_access()).channel(address, options=CLIENT_OPTIONS)
        self._stub = pb_grpc.PipelineServiceStub(self._channel)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close(None)

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the API's health check says SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service="m27.v1.PipelineService")
        try:
            reply = await stub.Check(request, timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise ClientError(f"the m27 API at {self.address} is not serving yet")

    async def submit(self, pipeline_yaml: str, *, vars: Mapping[str, str] | None = None,
                     user: str = "", urgency: Urgency | None = None, workdir: str = "",
                     source_name: str = "", no_cache: bool = False,
                     secrets: Mapping[str, str] | None = None) -> str:
        """Submit a pipeline; returns the new run id. `urgency` None keeps the file's.
        `secrets` are values of secret variables (only `env:`/`secrets:` may use them)."""
        request = pb.SubmitPipelineRequest(
            pipeline_yaml=pipeline_yaml, vars=dict(vars or {}), user=user,
            urgency=proto.urgency_to_proto(urgency) if urgency else pb.URGENCY_UNSPECIFIED,
            workdir=workdir, source_name=source_name, no_cache=no_cache,
            secrets=dict(secrets or {}))
        reply = await self._call(self._stub.SubmitPipeline, request)
        return str(reply.run_id)

    async def get_run(self, run_id: str) -> RunRecord:
        reply = await self._call(self._stub.GetRun, pb.GetRunRequest(run_id=run_id))
        return proto.run_from_proto(reply)

    async def list_runs(self, limit: int = 50, *, states: Sequence[RunState] = (),
                        user: str = "", since: float = 0.0,
                        page_token: str = "") -> tuple[list[RunSummary], str]:
        """One page of runs, newest first, and the token of the next page ('' if last)."""
        request = pb.ListRunsRequest(limit=limit, user=user, since=since,
                                     page_token=page_token,
                                     states=[proto.run_state_to_proto(s) for s in states])
        reply = await self._call(self._stub.ListRuns, request)
        runs = [
            RunSummary(run_id=r.run_id, name=r.name, user=r.user,
                       state=proto.run_state_from_proto(r.state), created_at=r.created_at,
                       ended_at=r.ended_at or None, steps_total=r.steps_total,
                       steps_succeeded=r.steps_succeeded, steps_failed=r.steps_failed)
            for r in reply.runs
        ]
        return runs, str(reply.next_page_token)

    async def cancel(self, run_id: str, reason: str = "", *, step: str = "") -> RunState:
        """Cancel the run, or with `step` only that step (its dependents are skipped)."""
        reply = await self._call(self._stub.CancelRun,
                                 pb.CancelRunRequest(run_id=run_id, reason=reason, step=step))
        return proto.run_state_from_proto(reply.state)

    async def retry(self, run_id: str) -> tuple[RunState, list[str]]:
        """Rerun a finished run's steps that did not succeed: (new state, those steps)."""
        reply = await self._call(self._stub.RetryRun, pb.RetryRunRequest(run_id=run_id))
        return proto.run_state_from_proto(reply.state), list(reply.steps)

    async def plan(self, pipeline_yaml: str, *, vars: Mapping[str, str] | None = None,
                   source_name: str = "", workdir: str = "", no_cache: bool = False,
                   secrets: Mapping[str, str] | None = None) -> Plan:
        """The server's plan: with start estimates, cache reuse and capacity checks."""
        request = pb.PlanPipelineRequest(pipeline_yaml=pipeline_yaml, vars=dict(vars or {}),
                                         source_name=source_name, workdir=workdir,
                                         no_cache=no_cache, secrets=dict(secrets or {}))
        reply = await self._call(self._stub.PlanPipeline, request)
        return msgspec.json.decode(reply.plan_json, type=Plan)

    async def watch(self, run_id: str,
                    after_sequence: int = 0) -> AsyncIterator[RunRecord | RunEvent]:
        """The run as it is now, then each event until (and including) its final one.

        With `after_sequence` (a RunEvent.sequence seen before) there is no snapshot: the
        events after it, so a watcher that lost its connection misses nothing."""
        stream = self._stub.WatchRun(pb.WatchRunRequest(run_id=run_id,
                                                        after_sequence=after_sequence))
        try:
            async for item in stream:
                if item.HasField("snapshot"):
                    yield proto.run_from_proto(item.snapshot)
                else:
                    yield _event_from_proto(item.event)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        finally:
            stream.cancel()

    async def events(self, run_id: str = "", *, follow: bool = False, since_s: float = 0.0,
                     limit: int = 0) -> AsyncIterator[BusEvent]:
        """Bus events, oldest first: every event of `run_id`, or without it the last `limit`
        (0: 200) events of the stream that you may see; `since_s`: those of the last that
        many seconds instead. With `follow`, new events as they come, until the caller stops."""
        stream = self._stub.WatchEvents(pb.WatchEventsRequest(
            run_id=run_id, follow=follow, since_s=since_s, limit=limit))
        try:
            async for reply in stream:
                yield _bus_event(reply)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        finally:
            stream.cancel()

    async def _call(self, method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
                    request: Req) -> Resp:
        try:
            return await method(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc

    def _error(self, exc: grpc.aio.AioRpcError) -> ClientError:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            return ApiUnavailable(f"cannot reach the m27 API at {self.address}: is it up? "
                                  "(start it with `m27 up`)")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ApiUnavailable(f"the m27 API at {self.address} did not answer in time")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ApiUnavailable(details or f"the m27 API at {self.address} is overloaded")
        if code == grpc.StatusCode.NOT_FOUND:
            return _NotFound(details)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return PipelineRejected(details)
        if code in _SAID_FOR_PEOPLE and details:
            return ClientError(details)  # e.g. "run … succeeded: nothing to retry"
        return ClientError(f"the m27 API refused the call ({code.name.lower()}): "
                           f"{details or 'no details'}")

    # ------------------------------------------------------------ the cluster (ClusterService)

    def _cluster(self) -> cluster_pb2_grpc.ClusterServiceAsyncStub:
        return cluster_pb2_grpc.ClusterServiceStub(self._channel)

    async def list_nodes(self) -> list[NodeStatus]:
        """Every registered node: state, CPU slots, GPUs with their latest readings and the
        tasks holding shares of them."""
        reply = await self._call(self._cluster().ListNodes, cluster_pb2.ListNodesRequest())
        return [node_from_proto(n) for n in reply.nodes]

    async def stream_logs(self, run_id: str, step: str, *, attempt: int = 0,
                          stream: str = "both", follow: bool = False,
                          tail_bytes: int = 0) -> AsyncIterator[LogChunk]:
        """A step's stdout/stderr chunks (attempt 0: the latest that ran); with `follow`,
        new output as it comes until the attempt ends. `tail_bytes`: start that many bytes
        before the end of each file."""
        call = self._cluster().StreamLogs(cluster_pb2.StreamLogsRequest(
            run_id=run_id, step=step, attempt=attempt, stream=stream, follow=follow,
            tail_bytes=tail_bytes))
        try:
            async for message in call:
                yield chunk_from_proto(message)
        except grpc.aio.AioRpcError as exc:
            raise self._logs_error(exc) from exc
        finally:
            call.cancel()

    def _logs_error(self, exc: grpc.aio.AioRpcError) -> ClientError:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE and from_cluster_service(exc):
            return ClientError(details)  # the node is unreachable, not the API
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            return ClientError(details)
        return self._error(exc)


#: Refusals whose details the services write as a sentence for the user: shown as they are.
_SAID_FOR_PEOPLE = frozenset({
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ABORTED,
})


class _NotFound(ClientError, NotFoundError):
    pass


class ApiUnavailable(ClientError, Unavailable):
    """The API could not be reached, did not answer in time or was overloaded: trying
    again later may work."""


def _event_from_proto(message: pb.RunEvent) -> RunEvent:
    return RunEvent(
        type=message.type, at=message.at, run_id=message.run_id, step=message.step,
        state=message.state, previous=message.previous, attempt=message.attempt,
        node_id=message.node_id,
        exit_code=message.exit_code if message.HasField("exit_code") else None,
        reason=message.reason, report_path=message.report_path,
        final=proto.is_final_event(message), sequence=message.sequence,
    )


def _bus_event(reply: pb.WatchEventsResponse) -> BusEvent:
    try:
        event: events.Event | None = events.decode_event(reply.event_json.encode())
    except ValueError:
        event = None
    return BusEvent(event=event, event_json=reply.event_json, subject=reply.subject,
                    sequence=reply.sequence, stored_at=reply.stored_at)
