"""`m27.v1.SchedulerService`: node maintenance and the queue, served by the scheduler.

Protobuf stays here: requests become calls on the `Scheduler`, its entries and the policy's
explanations become messages.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

import grpc
import msgspec

from m27.common.api_auth import caller
from m27.common.errors import InvalidRequest, NotFoundError
from m27.common.grpc_server import refuse
from m27.common.windows import (
    DEFAULT_LEAD_S,
    DEFAULT_TIMEOUT_S,
    EVERY,
    Window,
    WindowError,
)
from m27.scheduler import policy
from m27.scheduler._state import (
    Maintenance,
    MaintenanceState,
    TaskEntry,
    UnknownNode,
    running_of,
    tier_of,
)
from m27.scheduler._windows import WindowRecord
from m27.scheduler.model import PolicySettings
from m27.v1 import scheduler_pb2 as pb
from m27.v1 import scheduler_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from m27.scheduler.service import Scheduler

SERVICE_NAME: Final = "m27.v1.SchedulerService"
SERVICE_NAMES: Final = (SERVICE_NAME,)
#: A cordon's or drain's reason: a sentence for `m27 nodes`, stored with the mark in KV.
MAX_REASON_CHARS: Final = 1000
ACTIONS: Final[dict[str, MaintenanceState | None]] = {
    "cordon": "cordoned", "drain": "draining", "uncordon": None}

Context = grpc.aio.ServicerContext[object, object]


def maintenance_to_proto(node_id: str, mark: Maintenance | None, tasks: int) -> pb.NodeMaintenance:
    if mark is None:
        return pb.NodeMaintenance(node_id=node_id, tasks=tasks)
    return pb.NodeMaintenance(node_id=node_id, state=mark.state, reason=mark.reason,
                              since=mark.at, tasks=tasks)


def window_to_proto(record: WindowRecord) -> pb.MaintenanceWindow:
    window = record.window
    return pb.MaintenanceWindow(
        node_id=window.node_id, at=window.at, tz=window.tz, every=window.every,
        first_day=window.first_day, command=window.command, lead_s=window.lead_s,
        timeout_s=window.timeout_s, next_at=record.next_at or 0.0, phase=record.phase,
        occurrence=record.occurrence, runs=record.runs, last=record.last,
        created_by=window.created_by)


def window_of(request: pb.SetMaintenanceWindowRequest, *, created: float,
              created_by: str) -> Window:
    every = request.every or "once"
    if every not in EVERY:
        raise WindowError(f"--every {every[:40]!r}: expected one of {', '.join(EVERY)}")
    return Window(
        node_id=request.node_id, at=request.at, tz=request.tz or "UTC",
        every=every,  # checked above
        first_day=request.first_day, command=request.command,
        lead_s=request.lead_s if request.HasField("lead_s") else DEFAULT_LEAD_S,
        timeout_s=request.timeout_s if request.HasField("timeout_s") else DEFAULT_TIMEOUT_S,
        created=created, created_by=created_by)


def entry_state(entry: TaskEntry) -> str:
    if entry.placement is None:
        return "waiting"
    if entry.stopping:
        return "stopping"
    return "paused" if entry.paused else "running"


def protected(entry: TaskEntry, now: float, settings: PolicySettings) -> str:
    """Why the policy may not preempt this placed task now ("" if it may; "" for a waiting
    one, which holds nothing to preempt)."""
    running = running_of(entry)
    return "" if running is None else policy.protection(running, now, settings)


def entry_to_proto(entry: TaskEntry, explanation: policy.Explanation | None,
                   protection: str = "") -> pb.QueueEntry:
    task = entry.task
    placement = entry.placement
    message = pb.QueueEntry(
        task_id=task.task_id, run_id=task.run_id, step=task.step, attempt=task.attempt,
        urgency=task.urgency, user=task.user, gpus=task.resources.gpus,
        cpus=task.resources.cpus, state=entry_state(entry),
        node_id=placement.node_id if placement else "", queued_at=entry.queued_at,
        reason=entry.wait_reason if placement is None else entry.stopping,
        lender=placement.lender if placement else "", staged_on=entry.staged_nodes,
        staging_on=entry.staging_nodes, tier=tier_of(task), preemptions=task.preemptions,
        fruitless_preemptions=task.fruitless_preemptions, protected=protection)
    if explanation is not None:
        message.score = explanation.score.total
        message.explanation_json = msgspec.json.encode(explanation).decode()
        if placement is None and explanation.reason:
            message.reason = explanation.reason
    return message


class SchedulerServicer(pb_grpc.SchedulerServiceServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_SchedulerServiceServicer_to_server(self, server)

    async def SetNodeMaintenance(self, request: pb.SetNodeMaintenanceRequest,
                                 context: Context) -> pb.NodeMaintenance:
        if request.action not in ACTIONS:
            await refuse(context, InvalidRequest(
                f"unknown action {request.action[:100]!r}: cordon, drain or uncordon"))
        if len(request.reason) > MAX_REASON_CHARS:
            await refuse(context, InvalidRequest(
                f"the reason is {len(request.reason)} characters long, at most "
                f"{MAX_REASON_CHARS}"))
        try:
            mark = await self.scheduler.set_maintenance(request.node_id,
                                                        ACTIONS[request.action],
                                                        request.reason)
        except UnknownNode:
            await refuse(context, NotFoundError(f"no node {request.node_id[:100]!r} is registered"))
        return maintenance_to_proto(request.node_id, mark,
                                    self.scheduler.tasks_on(request.node_id))

    async def ListNodeMaintenance(self, request: pb.ListNodeMaintenanceRequest,
                                  context: Context) -> pb.ListNodeMaintenanceResponse:
        scheduler = self.scheduler
        names = sorted({*scheduler.nodes, *scheduler.maintenance})
        return pb.ListNodeMaintenanceResponse(nodes=[
            maintenance_to_proto(n, scheduler.maintenance.get(n), scheduler.tasks_on(n))
            for n in names])

    async def SetMaintenanceWindow(self, request: pb.SetMaintenanceWindowRequest,
                                   context: Context) -> pb.MaintenanceWindow:
        scheduler = self.scheduler
        if request.node_id not in scheduler.nodes:
            await refuse(context, NotFoundError(f"no node {request.node_id[:100]!r} is "
                                                "registered"))
        now = time.time()
        try:
            window = window_of(request, created=now, created_by=caller().user)
            async with scheduler.lock:
                record = await scheduler.windows.set(window, now)
        except WindowError as exc:
            await refuse(context, exc)
        if record is None:
            await refuse(context, InvalidRequest(
                f"the window {request.first_day} {request.at} {request.tz or 'UTC'} is over "
                "already: nothing to schedule"))
        scheduler.wake.set()
        return window_to_proto(record)

    async def ClearMaintenanceWindow(self, request: pb.ClearMaintenanceWindowRequest,
                                     context: Context) -> pb.MaintenanceWindow:
        async with self.scheduler.lock:
            record = await self.scheduler.windows.clear(request.node_id)
        if record is None:
            await refuse(context, NotFoundError(
                f"node {request.node_id[:100]!r} has no maintenance window"))
        return window_to_proto(record)

    async def ListMaintenanceWindows(self, request: pb.ListMaintenanceWindowsRequest,
                                     context: Context) -> pb.ListMaintenanceWindowsResponse:
        records = self.scheduler.windows.records
        return pb.ListMaintenanceWindowsResponse(
            windows=[window_to_proto(records[n]) for n in sorted(records)])

    async def ListQueue(self, request: pb.ListQueueRequest,
                        context: Context) -> pb.ListQueueResponse:
        scheduler = self.scheduler
        now = time.time()
        explained: dict[str, policy.Explanation] = {}
        async with scheduler.lock:
            entries = list(scheduler.entries.values())
            if request.explain:
                state, queue = scheduler.snapshot(now)
                explained = {e.task_id: e
                             for e in policy.explain(state, queue, now, scheduler.settings)}
        order = {task_id: i for i, task_id in enumerate(explained)}
        waiting = sorted((e for e in entries if e.placement is None),
                         key=lambda e: (order.get(e.task.task_id, len(order)), e.queued_at,
                                        e.task.task_id))
        placed = sorted((e for e in entries if e.placement is not None),
                        key=lambda e: (e.placed_at, e.task.task_id))
        settings = scheduler.settings
        return pb.ListQueueResponse(now=now, tasks=[
            entry_to_proto(e, explained.get(e.task.task_id), protected(e, now, settings))
            for e in [*waiting, *placed]])
