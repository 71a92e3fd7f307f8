"""The orchestrator's shell: the PipelineService gRPC API and the task-event consumer.

Decisions live in `pipeline` (parsing) and `runs` (the state machine); this module only
moves data between gRPC, the run store and the bus.
"""

from __future__ import annotations

import getpass
import time
from collections.abc import AsyncIterator
from typing import Final

import grpc
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from m27.common import bus as bus_module
from m27.common import events, proto, subjects
from m27.common.errors import NotFoundError
from m27.common.ids import is_valid_run_id, new_run_id
from m27.common.logging import bound_contextvars, get_logger
from m27.common.model import TERMINAL_RUN_STATES
from m27.common.service import ServiceRuntime
from m27.orchestrator import runs
from m27.orchestrator.pipeline import PipelineError, load_pipeline
from m27.orchestrator.store import RunExistsError, RunStore
from m27.v1 import pipeline_pb2 as pb
from m27.v1 import pipeline_pb2_grpc as pb_grpc

log = get_logger()

SERVICE_NAME: Final = "m27.v1.PipelineService"
DEFAULT_LIST_LIMIT: Final = 50
MAX_LIST_LIMIT: Final = 1000
MAX_USER_CHARS: Final = 100
MAX_WORKDIR_CHARS: Final = 4096


class PipelineServicer(pb_grpc.PipelineServiceServicer):
    def __init__(self, store: RunStore, gpu_light_share: float) -> None:
        self.store = store
        self.gpu_light_share = gpu_light_share

    async def SubmitPipeline(self, request: pb.SubmitPipelineRequest,
                             context: grpc.aio.ServicerContext[object, object],
                             ) -> pb.SubmitPipelineResponse:
        source = request.source_name[:200] or "<pipeline>"
        user = request.user or getpass.getuser()
        if len(user) > MAX_USER_CHARS or len(request.workdir) > MAX_WORKDIR_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "user or workdir is too long")
        if request.workdir and not request.workdir.startswith("/"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"workdir must be an absolute path, got {request.workdir!r}")
        try:
            spec = load_pipeline(request.pipeline_yaml, dict(request.vars), source=source,
                                 gpu_light_share=self.gpu_light_share)
        except PipelineError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        now = time.time()
        for _ in range(5):
            stored = runs.new_run(spec, run_id=new_run_id(now), user=user,
                                  urgency=proto.urgency_from_proto(request.urgency),
                                  variables=dict(request.vars), workdir=request.workdir,
                                  now=now)
            try:
                await self.store.create(stored)
            except RunExistsError:
                continue
            log.info("run.submitted", run_id=stored.run.run_id, user=user,
                     steps=len(stored.run.steps))
            return pb.SubmitPipelineResponse(run_id=stored.run.run_id)
        await context.abort(grpc.StatusCode.INTERNAL, "could not allocate a run id")
        raise AssertionError("context.abort raises")

    async def GetRun(self, request: pb.GetRunRequest,
                     context: grpc.aio.ServicerContext[object, object]) -> pb.Run:
        stored = await self._load(request.run_id, context)
        return proto.run_to_proto(stored.run)

    async def ListRuns(self, request: pb.ListRunsRequest,
                       context: grpc.aio.ServicerContext[object, object],
                       ) -> pb.ListRunsResponse:
        limit = request.limit or DEFAULT_LIST_LIMIT
        if not 0 < limit <= MAX_LIST_LIMIT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"limit must be between 1 and {MAX_LIST_LIMIT}")
        run_ids = sorted(await self.store.run_ids(), reverse=True)[:limit]
        summaries = []
        for run_id in run_ids:
            try:
                stored, _ = await self.store.get(run_id)
            except NotFoundError:
                continue
            summaries.append(proto.summary_to_proto(stored.run))
        return pb.ListRunsResponse(runs=summaries)

    async def CancelRun(self, request: pb.CancelRunRequest,
                        context: grpc.aio.ServicerContext[object, object],
                        ) -> pb.CancelRunResponse:
        await self._load(request.run_id, context)
        reason = request.reason[:500] or "cancelled on request"
        stored = await self.store.mutate(
            request.run_id, lambda s: runs.request_cancel(s, reason, time.time()))
        log.info("run.cancel_requested", run_id=request.run_id, state=stored.run.state)
        return pb.CancelRunResponse(state=proto.run_to_proto(stored.run).state)

    async def WatchRun(self, request: pb.WatchRunRequest,
                       context: grpc.aio.ServicerContext[object, object],
                       ) -> AsyncIterator[pb.WatchRunResponse]:
        await self._load(request.run_id, context)
        # Subscribe before reading the snapshot so no event can fall between the two.
        sub = await self.store.bus.js.subscribe(
            subjects.run_events(request.run_id), ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW)
        try:
            stored = await self._load(request.run_id, context)
            yield pb.WatchRunResponse(snapshot=proto.run_to_proto(stored.run))
            if stored.run.state in TERMINAL_RUN_STATES:
                return
            async for item in _events(sub):
                message = proto.event_to_proto(item)
                yield pb.WatchRunResponse(event=message)
                if proto.is_final_event(message):
                    return
        finally:
            await sub.unsubscribe()

    async def _load(self, run_id: str,
                    context: grpc.aio.ServicerContext[object, object]) -> runs.StoredRun:
        if not is_valid_run_id(run_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"not a run id: {run_id[:80]!r} (run ids look like "
                                "r-20261201-081500-a1b2c3)")
        try:
            stored, _ = await self.store.get(run_id)
        except NotFoundError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no run {run_id}")
        return stored


async def _events(sub: JetStreamContext.PushSubscription) -> AsyncIterator[events.Event]:
    """Decoded events of a JetStream subscription; undecodable ones are logged and skipped."""
    while True:
        try:
            msg = await sub.next_msg(timeout=5.0)
        except TimeoutError:
            continue
        try:
            yield events.decode_event(msg.data)
        except (ValueError, TypeError) as exc:
            log.warning("watch.undecodable_event", subject=msg.subject, error=str(exc))


class EventHandlers:
    """What the orchestrator does with task and report events from the bus."""

    def __init__(self, store: RunStore) -> None:
        self.store = store

    async def on_task_event(self, msg: Msg) -> None:
        event = bus_module.decode_or_poison(msg.data, events.decode_event)
        if not isinstance(event, events.TaskPlaced | events.TaskStarted | events.TaskExited):
            return
        with bound_contextvars(run_id=event.run_id, task_id=event.task_id):
            try:
                stored = await self.store.mutate(
                    event.run_id, lambda s: runs.apply_task_event(s, event, time.time()))
            except NotFoundError:
                log.warning("task_event.unknown_run", type=events.tag_of(event))
                return
            step = stored.run.step(event.step)
            log.info("task_event.applied", type=events.tag_of(event),
                     step_state=step.state if step else None, run_state=stored.run.state)

    async def on_report(self, msg: Msg) -> None:
        event = bus_module.decode_or_poison(msg.data, events.decode_event)
        if not isinstance(event, events.ReportReady):
            return
        try:
            await self.store.mutate(event.run_id, lambda s: runs.record_report(s, event))
        except NotFoundError:
            log.warning("report.unknown_run", run_id=event.run_id)


async def serve(rt: ServiceRuntime) -> None:
    bus = await rt.connect()
    store = RunStore(bus)
    servicer = PipelineServicer(store, rt.config.scheduler.gpu_light_share)
    await rt.serve_grpc([lambda server: pb_grpc.add_PipelineServiceServicer_to_server(
        servicer, server)], [SERVICE_NAME])
    await store.recover()
    handlers = EventHandlers(store)
    rt.spawn(bus_module.consume(
        bus.js, stream=subjects.EVENTS_STREAM, durable=subjects.ORCHESTRATOR_TASK_EVENTS,
        filter_subject=subjects.TASK_EVENTS_ALL, handle=handlers.on_task_event,
        stop=rt.stop), "task-events")
    rt.spawn(bus_module.consume(
        bus.js, stream=subjects.EVENTS_STREAM, durable=subjects.ORCHESTRATOR_REPORTS,
        filter_subject=subjects.RUN_REPORT_ALL, handle=handlers.on_report, stop=rt.stop),
        "reports")
    await rt.ready()
    await rt.stop.wait()
