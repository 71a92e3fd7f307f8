"""The client of the scheduler's API (`m27.v1.SchedulerService`): node maintenance and the
queue, returned as plain structs.

    async with SchedulerClient("127.0.0.1:50052") as scheduler:
        await scheduler.set_maintenance("node-1", "drain", reason="nightly GPU reset")
        for task in await scheduler.queue(explain=True):
            ...
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any, Literal

import grpc
import msgspec

from m27.common.api_auth import ApiAccess, default_access
from m27.common.errors import M27Error
from m27.common.grpc_server import CLIENT_OPTIONS
from m27.v1 import scheduler_pb2 as pb
from m27.v1 import scheduler_pb2_grpc as pb_grpc

Action = Literal["cordon", "drain", "uncordon"]


class SchedulerError(M27Error):
    """The scheduler could not be reached or refused the call."""


class NodeMaintenance(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    state: str  # "" (in service), cordoned, draining
    reason: str = ""
    since: float = 0.0
    tasks: int = 0  # still placed there: 0 means it is empty


class QueueItem(msgspec.Struct, frozen=True, kw_only=True):
    task_id: str
    run_id: str
    step: str
    attempt: int
    urgency: str
    user: str
    gpus: float
    cpus: int
    state: str  # waiting, running, paused, stopping
    node_id: str
    queued_at: float
    reason: str
    score: float
    tier: str
    lender: str = ""
    staged_on: tuple[str, ...] = ()  # ready pool: inputs read ahead on these nodes
    staging_on: tuple[str, ...] = ()  # ready pool: being read ahead on these nodes
    explanation: dict[str, Any] | None = None
    preemptions: int = 0  # times this step was preempted, all attempts
    fruitless_preemptions: int = 0  # latest ones in a row before any checkpoint
    #: A placed task: why it may not be preempted now ("" if it may, and when waiting).
    protected: str = ""


class WindowStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A node's maintenance window and where it stands (`m27 node windows`)."""

    node_id: str
    at: str
    tz: str
    every: str
    first_day: str
    command: str
    lead_s: float
    timeout_s: float
    next_at: float | None  # None: no occurrence left
    phase: str  # scheduled, draining, running
    occurrence: float
    runs: int
    last: str
    created_by: str


def _window(message: pb.MaintenanceWindow) -> WindowStatus:
    return WindowStatus(
        node_id=message.node_id, at=message.at, tz=message.tz, every=message.every,
        first_day=message.first_day, command=message.command, lead_s=message.lead_s,
        timeout_s=message.timeout_s, next_at=message.next_at or None, phase=message.phase,
        occurrence=message.occurrence, runs=message.runs, last=message.last,
        created_by=message.created_by)


def _maintenance(message: pb.NodeMaintenance) -> NodeMaintenance:
    return NodeMaintenance(node_id=message.node_id, state=message.state,
                           reason=message.reason, since=message.since, tasks=message.tasks)


def _item(message: pb.QueueEntry) -> QueueItem:
    explanation = json.loads(message.explanation_json) if message.explanation_json else None
    return QueueItem(
        task_id=message.task_id, run_id=message.run_id, step=message.step,
        attempt=message.attempt, urgency=message.urgency, user=message.user,
        gpus=message.gpus, cpus=message.cpus, state=message.state, node_id=message.node_id,
        queued_at=message.queued_at, reason=message.reason, score=message.score,
        tier=message.tier, lender=message.lender, staged_on=tuple(message.staged_on),
        staging_on=tuple(message.staging_on), explanation=explanation,
        preemptions=message.preemptions,
        fruitless_preemptions=message.fruitless_preemptions, protected=message.protected)


class SchedulerClient:
    def __init__(self, address: str, *, access: ApiAccess | None = None,
                 timeout: float = 15.0) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = (access or default_access()).channel(address, options=CLIENT_OPTIONS)
        self._stub = pb_grpc.SchedulerServiceStub(self._channel)

    async def __aenter__(self) -> SchedulerClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._channel.close(None)

    def _error(self, exc: grpc.aio.AioRpcError) -> SchedulerError:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return SchedulerError(f"cannot reach the scheduler at {self.address}: is it up?")
        return SchedulerError(exc.details() or exc.code().name.lower())

    async def set_maintenance(self, node_id: str, action: Action,
                              reason: str = "") -> NodeMaintenance:
        request = pb.SetNodeMaintenanceRequest(node_id=node_id, action=action, reason=reason)
        try:
            return _maintenance(await self._stub.SetNodeMaintenance(request,
                                                                    timeout=self.timeout))
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def maintenance(self) -> list[NodeMaintenance]:
        try:
            reply = await self._stub.ListNodeMaintenance(pb.ListNodeMaintenanceRequest(),
                                                         timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return [_maintenance(m) for m in reply.nodes]

    async def set_window(self, node_id: str, *, at: str, tz: str = "UTC", every: str = "once",
                         first_day: str = "", command: str = "", lead_s: float | None = None,
                         timeout_s: float | None = None) -> WindowStatus:
        """Set (replace) the node's maintenance window; SchedulerError says what is wrong."""
        request = pb.SetMaintenanceWindowRequest(node_id=node_id, at=at, tz=tz, every=every,
                                                 first_day=first_day, command=command)
        if lead_s is not None:
            request.lead_s = lead_s
        if timeout_s is not None:
            request.timeout_s = timeout_s
        try:
            return _window(await self._stub.SetMaintenanceWindow(request, timeout=self.timeout))
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def clear_window(self, node_id: str) -> WindowStatus:
        request = pb.ClearMaintenanceWindowRequest(node_id=node_id)
        try:
            return _window(await self._stub.ClearMaintenanceWindow(request,
                                                                   timeout=self.timeout))
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def windows(self) -> list[WindowStatus]:
        try:
            reply = await self._stub.ListMaintenanceWindows(
                pb.ListMaintenanceWindowsRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return [_window(w) for w in reply.windows]

    async def queue(self, *, explain: bool = False) -> list[QueueItem]:
        try:
            reply = await self._stub.ListQueue(pb.ListQueueRequest(explain=explain),
                                               timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return [_item(t) for t in reply.tasks]
