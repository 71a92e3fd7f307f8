"""`m27.v1.PipelineService`: the public gRPC API, a thin edge over the engine and the cores.

Protobuf stops here: requests become domain values, problems become gRPC statuses with
messages a person can act on (INVALID_ARGUMENT for a bad pipeline or id, NOT_FOUND for an
unknown run or step, FAILED_PRECONDITION for a retry that cannot happen).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Final

import grpc
import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from m27.common import api_access, events, proto, subjects
from m27.common.api_auth import caller
from m27.common.errors import (
    Internal,
    InvalidRequest,
    NotFoundError,
    OutOfRange,
    PermissionDenied,
    Refused,
    ResourceExhausted,
)
from m27.common.grpc_server import refuse
from m27.common.hints import one_of
from m27.common.ids import is_valid_run_id, new_run_id
from m27.common.logging import get_logger
from m27.common.model import TERMINAL_RUN_STATES, NodeInfo, RunRecord
from m27.common.tokens import USER_NAME, Identity
from m27.orchestrator import event_feed, history, runs
from m27.orchestrator.engine import Engine
from m27.orchestrator.event_reader import EventReader
from m27.orchestrator.parsing import in_child
from m27.orchestrator.store import RunExistsError
from m27.pipeline import PipelineError, PipelineSpec, Problem, load_pipeline
from m27.pipeline.plan import capacity_problems, make_plan
from m27.v1 import pipeline_pb2 as pb
from m27.v1 import pipeline_pb2_grpc as pb_grpc

log = get_logger()

SERVICE_NAME: Final = "m27.v1.PipelineService"
MAX_USER_CHARS: Final = 100
MAX_WORKDIR_CHARS: Final = 4096
RESUME_IDLE_S: Final = 1.0
#: Documents parsed and planned at once (each in a child process with a time and memory
#: budget, `parsing.in_child`): a flood of submissions queues here instead of taking every
#: core and all the memory.
PARSERS: Final = 2
#: The highest sequence a JetStream stream can reach (a uint64 less the one added here).
MAX_SEQUENCE: Final = 2**63 - 1
#: `WatchEvents` streams served at once; more are RESOURCE_EXHAUSTED. What one holds is
#: bounded: a page of messages (`event_reader.PAGE`), the tail it keeps
#: (`event_feed.MAX_LIMIT` events at most) and the run owners it looked up (`FEED_OWNERS`);
#: a slow client only makes its gRPC writes, and so the reading, wait.
MAX_EVENT_FEEDS: Final = 32
#: Run owners a feed remembers (it looks each run up once); beyond that it starts afresh.
FEED_OWNERS: Final = 4096

Context = grpc.aio.ServicerContext[object, object]


class PipelineServicer(pb_grpc.PipelineServiceServicer):
    def __init__(self, engine: Engine, gpu_light_share: float,
                 levels: api_access.Levels) -> None:
        self.engine = engine
        self.store = engine.store
        self.gpu_light_share = gpu_light_share
        self.levels = levels
        self._parsing = asyncio.Semaphore(PARSERS)
        self._feeds = 0

    # ------------------------------------------------------------ submit and plan

    async def SubmitPipeline(self, request: pb.SubmitPipelineRequest,
                             context: Context) -> pb.SubmitPipelineResponse:
        who = caller()
        if request.user and not USER_NAME.fullmatch(request.user):
            await refuse(context, InvalidRequest(
                f"user {request.user[:MAX_USER_CHARS]!r} is not a user name (letters, digits, "
                "_ . @ -, at most 100)"))
        user, claimed_other = api_access.submitter(who, request.user)
        if claimed_other:
            await refuse(context, PermissionDenied(claimed_other))
        spec = await self._load(request.pipeline_yaml, dict(request.vars), request.source_name,
                                request.workdir, request.urgency, context,
                                secrets=dict(request.secrets))
        too_urgent = api_access.urgency_problem(who, [s.urgency for s in spec.steps],
                                                self.levels)
        if too_urgent:
            await refuse(context, PermissionDenied(too_urgent))
        await self._check_capacity(spec, request.source_name, context)
        now = time.time()
        for _ in range(5):
            run_id = new_run_id(now)
            keys = await self.engine.secrets.store(run_id, spec.secret_sets)
            stored = runs.new_run(spec, run_id=run_id, user=user,
                                  variables=spec.variables, workdir=request.workdir, now=now,
                                  use_cache=not request.no_cache,
                                  source_name=request.source_name[:200], secret_keys=keys)
            try:
                await self.engine.create(stored)
            except RunExistsError:
                await self.engine.secrets.forget(keys)
                continue
            except BaseException:
                await self.engine.secrets.forget(keys)
                raise
            log.info("run.submitted", run_id=stored.run.run_id, user=user,
                     steps=len(stored.run.steps))
            return pb.SubmitPipelineResponse(run_id=stored.run.run_id)
        await refuse(context, Internal("could not allocate a run id"))
        raise AssertionError("unreachable")

    async def PlanPipeline(self, request: pb.PlanPipelineRequest,
                           context: Context) -> pb.PlanPipelineResponse:
        spec = await self._load(request.pipeline_yaml, dict(request.vars), request.source_name,
                                request.workdir, pb.URGENCY_UNSPECIFIED, context,
                                secrets=dict(request.secrets))
        durations = await history.durations(self.store, spec.name)
        reuse = await history.predicted_reuse(self.engine.cache, spec, request.workdir,
                                              use_cache=not request.no_cache)
        nodes = await self._nodes()
        try:
            async with self._parsing:
                plan = await in_child(make_plan, spec, what="planning", durations=durations,
                                      reuse=reuse, nodes=nodes)
        except ResourceExhausted as exc:
            await refuse(context, exc)
        return pb.PlanPipelineResponse(plan_json=msgspec.json.encode(plan).decode())

    async def _load(self, text: str, variables: dict[str, str], source_name: str,
                    workdir: str, urgency: pb.Urgency.ValueType,
                    context: Context, secrets: dict[str, str]) -> PipelineSpec:
        if len(workdir) > MAX_WORKDIR_CHARS or (workdir and not workdir.startswith("/")):
            await refuse(context, InvalidRequest(
                f"workdir must be an absolute path, got {workdir[:200]!r}"))
        if urgency not in pb.Urgency.values():
            await refuse(context, InvalidRequest(f"unknown urgency {urgency}"))
        given = None if urgency == pb.URGENCY_UNSPECIFIED else proto.urgency_from_proto(urgency)
        try:  # in a child with a budget: every other call keeps being answered meanwhile
            async with self._parsing:
                return await in_child(
                    load_pipeline, text, variables, what="parsing",
                    source=source_name[:200] or "<pipeline>",
                    gpu_light_share=self.gpu_light_share, urgency=given, workdir=workdir,
                    secrets=secrets)
        except (PipelineError, ResourceExhausted) as exc:
            await refuse(context, exc)

    async def _nodes(self) -> list[NodeInfo]:
        bus = self.store.bus
        found = [await bus.kv_get(subjects.NODES_BUCKET, key, NodeInfo)
                 for key in await bus.kv_keys(subjects.NODES_BUCKET)]
        return [entry[0] for entry in found if entry is not None and entry[0].state == "up"]

    async def _check_capacity(self, spec: PipelineSpec, source: str,
                              context: Context) -> None:
        """A step no node could ever run is an error now, not a step waiting forever."""
        nodes = await self._nodes()
        if not nodes:
            return  # nodes may join later
        problems = capacity_problems(spec.steps, nodes)
        if problems:
            error = PipelineError(source or "<pipeline>", [
                Problem(message=p, hint="nodes: " + ", ".join(
                    f"{n.node_id} ({len(n.gpus)} GPU, {n.cpu_slots} CPU)" for n in nodes))
                for p in problems])
            await refuse(context, error)

    # ------------------------------------------------------------ runs

    async def GetRun(self, request: pb.GetRunRequest,
                     context: Context) -> pb.Run:
        return proto.run_to_proto((await self._get(request.run_id, context,
                                                   acting=False)).run)

    async def ListRuns(self, request: pb.ListRunsRequest,
                       context: Context) -> pb.ListRunsResponse:
        try:
            query = history.Query.from_request(request)
        except ValueError as exc:
            await refuse(context, InvalidRequest(str(exc)))
        who = caller()
        if not who.reads_everything:  # a user lists their own runs only
            if query.user and query.user != who.user:
                await refuse(context, PermissionDenied(
                    f"you are {who.user}: only an admin may list another user's runs"))
            query = msgspec.structs.replace(query, user=who.user)
        found, token = await history.list_runs(self.store, query)
        return pb.ListRunsResponse(runs=[proto.summary_to_proto(r) for r in found],
                                   next_page_token=token)

    async def CancelRun(self, request: pb.CancelRunRequest,
                        context: Context) -> pb.CancelRunResponse:
        stored = await self._get(request.run_id, context)
        reason = request.reason[:500]
        if request.step:
            await self._require_step_or_abort(stored.run, request.step, context)
            stored = await self.engine.change(request.run_id, lambda s: runs.request_cancel_step(
                s, request.step, reason, time.time()))
        else:
            stored = await self.engine.change(request.run_id, lambda s: runs.request_cancel(
                s, reason or "cancelled on request", time.time()))
        log.info("run.cancel_requested", run_id=request.run_id, step=request.step or None)
        return pb.CancelRunResponse(state=proto.run_to_proto(stored.run).state)

    async def _require_step_or_abort(self, run: RunRecord, name: str, context: Context) -> None:
        if run.step(name) is None:
            hint = one_of(name, [s.name for s in run.steps], "its steps")
            await refuse(context, NotFoundError(
                f"run {run.run_id} has no step {name[:100]!r}" + (f" ({hint})" if hint else "")))

    async def RetryRun(self, request: pb.RetryRunRequest,
                       context: Context) -> pb.RetryRunResponse:
        current = await self._get(request.run_id, context)
        if current.run.secret_keys and current.run.state in TERMINAL_RUN_STATES \
                and await self.engine.secrets.missing(current.run):
            await refuse(context, Refused(
                f"run {request.run_id}'s secret values are gone (kept "
                f"{subjects.SECRETS_TTL_S / 86400:.0f} days at most): submit the pipeline "
                "again with its --secret values"))
        refusal: list[str] = []
        again: list[str] = []

        def decide(stored: runs.StoredRun) -> runs.StoredRun | None:
            refusal.clear()
            result = runs.retry_run(stored, time.time())
            if isinstance(result, str):
                refusal.append(result)
                return None
            again[:] = [s.name for s in stored.run.steps if s.state != "succeeded"]
            return result

        stored = await self.engine.change(request.run_id, decide)
        if refusal:
            await refuse(context, Refused(refusal[0]))
        log.info("run.retry", run_id=request.run_id, steps=len(again))
        return pb.RetryRunResponse(state=proto.run_to_proto(stored.run).state, steps=again)

    async def WatchRun(self, request: pb.WatchRunRequest,
                       context: Context) -> AsyncIterator[pb.WatchRunResponse]:
        if request.after_sequence > MAX_SEQUENCE:
            await refuse(context, OutOfRange(
                f"after_sequence {request.after_sequence} is beyond any stream's sequence "
                f"(at most {MAX_SEQUENCE})"))
        await self._get(request.run_id, context, acting=False)
        subject = subjects.run_events(request.run_id)
        js = self.store.bus.js
        if request.after_sequence:
            sub = await js.subscribe(subject, ordered_consumer=True, config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=request.after_sequence + 1))
        else:  # subscribe before the snapshot so no event falls between the two
            sub = await js.subscribe(subject, ordered_consumer=True,
                                     deliver_policy=DeliverPolicy.NEW)
        try:
            stored = await self._get(request.run_id, context, acting=False)
            finished = stored.run.state in TERMINAL_RUN_STATES
            if not request.after_sequence:
                yield pb.WatchRunResponse(snapshot=proto.run_to_proto(stored.run))
                if finished:
                    return
            async for message in _events(sub, idle_s=RESUME_IDLE_S if finished else None):
                yield pb.WatchRunResponse(event=message)
                if proto.is_final_event(message):
                    return
        finally:
            await sub.unsubscribe()

    async def WatchEvents(self, request: pb.WatchEventsRequest,
                          context: Context) -> AsyncIterator[pb.WatchEventsResponse]:
        try:
            query = event_feed.FeedQuery.from_request(request)
        except ValueError as exc:
            await refuse(context, InvalidRequest(str(exc)))
        if query.run_id:
            await self._get(query.run_id, context, acting=False)
        if self._feeds >= MAX_EVENT_FEEDS:
            await refuse(context, ResourceExhausted(
                f"{MAX_EVENT_FEEDS} event streams are open on this orchestrator, the most it "
                "serves at once: try again later"))
        self._feeds += 1
        try:
            async for reply in self._feed(query, caller()):
                yield reply
        finally:
            self._feeds -= 1

    async def _feed(self, query: event_feed.FeedQuery,
                    who: Identity) -> AsyncIterator[pb.WatchEventsResponse]:
        js = self.store.bus.js
        last = (await js.stream_info(subjects.EVENTS_STREAM)).state.last_seq
        start = event_feed.start_of(query, last, time.time())
        reader = EventReader(js, query.run_id, start)
        try:
            feed = event_feed.Feed[pb.WatchEventsResponse](
                keep_last=start.keep_last, follow=query.follow, caught_up=await reader.open())
            owners: dict[str, str | None] = {}
            while not feed.done:
                msg = await reader.next()
                if msg is None:
                    ready = feed.idle()
                else:
                    item = await self._feed_item(msg, who, owners, query.run_id)
                    ready = feed.take(item, msg.metadata.num_pending or 0)
                for reply in ready:
                    yield reply
        finally:
            await reader.close()

    async def _feed_item(self, msg: Msg, who: Identity, owners: dict[str, str | None],
                         run_id: str) -> pb.WatchEventsResponse | None:
        """The event as a reply, or None: one `who` may not see, or not an event."""
        scope = event_feed.scope_of(msg.subject)
        owner = None
        if scope.run_id and not (run_id or who.reads_everything):
            owner = await self._owner(scope.run_id, owners)
        if not (run_id or api_access.sees_event(who, node_event=scope.node,
                                                 run_owner=owner)):
            return None
        try:
            events.decode_event(msg.data)
        except ValueError as exc:
            log.warning("feed.undecodable_event", subject=msg.subject, error=str(exc))
            return None
        meta = msg.metadata
        return pb.WatchEventsResponse(
            event_json=msg.data.decode(errors="replace"), subject=msg.subject,
            sequence=meta.sequence.stream,
            stored_at=meta.timestamp.timestamp() if meta.timestamp else 0.0)

    async def _owner(self, run_id: str, owners: dict[str, str | None]) -> str | None:
        """Whose run this is (None: no such run), looked up once per feed."""
        if run_id not in owners:
            if len(owners) >= FEED_OWNERS:
                owners.clear()
            owner = None
            if is_valid_run_id(run_id):
                with contextlib.suppress(NotFoundError):
                    owner = (await self.store.get(run_id))[0].run.user
            owners[run_id] = owner
        return owners[run_id]

    async def _get(self, run_id: str, context: Context, *,
                   acting: bool = True) -> runs.StoredRun:
        """The run, if the caller may see it (`acting`: change it)."""
        if not is_valid_run_id(run_id):
            await refuse(context, InvalidRequest(
                f"not a run id: {run_id[:80]!r} (run ids look like r-20261201-081500-a1b2c3)"))
        try:
            stored, _ = await self.store.get(run_id)
        except NotFoundError:
            await refuse(context, NotFoundError(f"no run {run_id}"))
        problem = api_access.run_problem(caller(), stored.run.user, run_id, acting=acting)
        if problem:
            await refuse(context, PermissionDenied(problem))
        return stored


async def _events(sub: JetStreamContext.PushSubscription,
                  idle_s: float | None) -> AsyncIterator[pb.RunEvent]:
    """The subscription's events with their stream sequence; with `idle_s`, it ends once
    nothing arrived for that long (a resumed watch of a run that already ended)."""
    while True:
        try:
            msg = await sub.next_msg(timeout=idle_s or 5.0)
        except TimeoutError:
            if idle_s is not None:
                return
            continue
        try:
            event = events.decode_event(msg.data)
        except ValueError as exc:
            log.warning("watch.undecodable_event", subject=msg.subject, error=str(exc))
            continue
        yield proto.event_to_proto(event, sequence=msg.metadata.sequence.stream)
