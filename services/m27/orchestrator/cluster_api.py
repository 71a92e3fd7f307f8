"""`m27.v1.ClusterService`: the cluster as people look at it, and step logs.

`ListNodes` joins what each node-agent last stored in the nodes bucket (GPU readings, what
each task holds) with the scheduler's task table (CPU slots booked). `StreamLogs` finds the
node that ran a step's attempt and relays that node-agent's `TailLog`; when the agent is
gone but its log files are on this machine (everything on one host), it reads them itself.
The decisions (`node_state`, `find_attempt`) are pure; the servicer is the shell.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Final, Literal, TypeVar

import grpc
import msgspec

from m27.common import api_access, logfiles, platform, subjects
from m27.common.api_auth import ApiAccess, caller
from m27.common.bus import Bus
from m27.common.errors import (
    InvalidRequest,
    M27Error,
    NotFoundError,
    PermissionDenied,
    Refused,
    Unavailable,
)
from m27.common.grpc_server import CLIENT_OPTIONS, abort, refuse
from m27.common.hints import one_of
from m27.common.ids import is_valid_name, is_valid_run_id, task_id
from m27.common.logfiles import LogChunk, LogQuery, Stream
from m27.common.logging import get_logger
from m27.common.model import (
    TERMINAL_STEP_STATES,
    GpuInfo,
    GpuSample,
    NodeInfo,
    RunRecord,
    ServiceInfo,
    TaskHolding,
)
from m27.orchestrator.store import RunStore
from m27.v1 import cluster_pb2 as pb
from m27.v1 import cluster_pb2_grpc as pb_grpc

log = get_logger()

T = TypeVar("T")

SERVICE_NAME: Final = "m27.v1.ClusterService"
NODE_AGENT_SERVICE: Final = "node-agent"
#: How often a follow waits for a step to start, and re-reads the run when reading logs
#: locally (the agent that would say "it ended" is gone).
WAIT_POLL_S: Final = 0.5
#: Trailing metadata on the UNAVAILABLE this service sends itself, so a client can tell
#: "the node is unreachable" from "the API is unreachable".
ERROR_ORIGIN: Final = ("m27-error-origin", "cluster-service")
MAX_ATTEMPT: Final = 1_000_000

Context = grpc.aio.ServicerContext[object, object]
NodeState = Literal["up", "stopping", "stopped", "lost"]


# ---------------------------------------------------------------- pure: nodes


def node_state(info: NodeInfo, now: float, node_timeout: float) -> NodeState:
    """Stopped as the agent said; lost once its last heartbeat is older than node_timeout.

    The age compares the agent's clock with this one (NodeInfo carries wall-clock time);
    the scheduler, which acts on it, uses renewal counts instead.
    """
    if info.state == "stopped":
        return "stopped"
    if now - info.last_heartbeat > node_timeout:
        return "lost"
    return info.state


def share_of_each(holding: TaskHolding) -> float:
    """The share of each of its GPUs a task holds (as `per_gpu_share` on the agent)."""
    if not holding.gpu_ids:
        return 0.0
    if holding.gpu_share <= 0:
        return 1.0
    if holding.gpu_share > 1:
        return min(1.0, holding.gpu_share / len(holding.gpu_ids))
    return holding.gpu_share


def _gpu_to_proto(gpu: GpuInfo, sample: GpuSample | None,
                  holdings: Sequence[TaskHolding]) -> pb.Gpu:
    message = pb.Gpu(
        index=gpu.index, name=gpu.name, uuid=gpu.uuid,
        simulated=gpu.simulated or (sample is not None and sample.simulated),
        memory_total_mb=(sample.memory_total_mb if sample else 0) or gpu.memory_total_mb,
        holdings=[pb.Holding(task_id=h.task_id, attempt=h.attempt, share=share_of_each(h),
                             paused=h.paused)
                  for h in holdings if gpu.index in h.gpu_ids])
    if sample is not None:
        message.memory_used_mb = sample.memory_used_mb
        message.utilization_pct = sample.utilization_pct
        message.temperature_c = sample.temperature_c
        message.power_w = sample.power_w or 0.0
        message.power_limit_w = sample.power_limit_w or 0.0
        message.throttle.extend(sample.throttle)
    return message


def node_to_proto(info: NodeInfo, *, now: float, node_timeout: float,
                  cpu_used: int, differences: Sequence[str] = ()) -> pb.Node:
    samples = {s.index: s for s in info.samples}
    return pb.Node(
        node_id=info.node_id, hostname=info.hostname, backend=info.backend,
        state=node_state(info, now, node_timeout),
        heartbeat_age_s=max(0.0, now - info.last_heartbeat), cpu_slots=info.cpu_slots,
        cpu_used=cpu_used, cgroups=info.cgroups, mps=info.mps, incarnation=info.incarnation,
        gpus=[_gpu_to_proto(g, samples.get(g.index), info.holdings) for g in info.gpus],
        driver_version=info.platform.driver, cuda_version=info.platform.cuda,
        nvml_version=info.platform.nvml, platform_differences=list(differences))


def live_differences(nodes: Sequence[NodeInfo], *, now: float,
                     node_timeout: float) -> dict[str, tuple[str, ...]]:
    """Driver/CUDA differences among the nodes that are up (a stopped or lost node's old
    driver is no warning)."""
    return platform.differences({n.node_id: n.platform for n in nodes
                                 if node_state(n, now, node_timeout) == "up"})


class _Booking(msgspec.Struct):
    """The part of the scheduler's `Placement` this view needs (services never import
    each other; unknown fields are ignored)."""

    node_id: str
    cpus: int = 0


class _TaskEntry(msgspec.Struct):
    placement: _Booking | None = None


def cpus_booked(entries: Sequence[_TaskEntry]) -> dict[str, int]:
    """CPU slots the scheduler has booked on each node."""
    used: dict[str, int] = {}
    for entry in entries:
        if entry.placement is not None:
            node = entry.placement.node_id
            used[node] = used.get(node, 0) + entry.placement.cpus
    return used


# ---------------------------------------------------------------- pure: which attempt


class Found(msgspec.Struct, frozen=True, kw_only=True):
    attempt: int
    node_id: str


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """Why there are no logs to show; `waitable`: there will be once the step starts."""

    code: Literal["not_found", "failed_precondition"]
    message: str
    waitable: bool = False

    def error(self) -> M27Error:
        """The refusal as the error family whose gRPC status it ends the call with."""
        return NotFoundError(self.message) if self.code == "not_found" else Refused(self.message)


def find_attempt(run: RunRecord, name: str, attempt: int) -> Found | Refusal:
    """The attempt whose logs are asked for (0: the latest that started) and its node."""
    step = run.step(name)
    if step is None:
        hint = one_of(name, [s.name for s in run.steps], "its steps")
        return Refusal(code="not_found", message=f"run {run.run_id} has no step {name!r}"
                       + (f" ({hint})" if hint else ""))
    ran = {a.attempt: a.node_id for a in step.history if a.started_at is not None}
    if step.state == "running" and step.node_id:
        ran[step.attempt] = step.node_id
    if step.cached_from and not ran:
        source_run, _, source_step = step.cached_from.partition("/")
        return Refusal(code="not_found", message=f"step {name} did not run: it reused the "
                       f"results of {step.cached_from} (see `m27 logs {source_run} "
                       f"{source_step}`)")
    wanted = attempt or max(ran, default=step.attempt)
    node = ran.get(wanted)
    if node:
        return Found(attempt=wanted, node_id=node)
    if wanted == step.attempt:
        ended = step.state in TERMINAL_STEP_STATES
        what = f"attempt {wanted} of step {name}" if wanted else f"step {name}"
        why = f": {step.reason}" if step.reason else ""
        return Refusal(code="failed_precondition", waitable=not ended,
                       message=f"{what} has no logs: it "
                       f"{'never ran' if ended else 'has not started yet'} ({step.state}{why})")
    tried = ", ".join(str(a) for a in sorted(ran)) or "none"
    return Refusal(code="not_found",
                   message=f"step {name} has no attempt {wanted} (attempts that ran: {tried})")


# ---------------------------------------------------------------- protobuf edge


def chunk_to_proto(chunk: LogChunk) -> pb.LogChunk:
    return pb.LogChunk(stream=chunk.stream, data=chunk.data, offset=chunk.offset)


def stream_name(streams: Sequence[Stream]) -> str:
    return streams[0] if len(streams) == 1 else "both"


#: What a relay treats as "the agent is not there": down, or an older agent without
#: NodeService (or something else now listening on its old port).
_UNREACHABLE: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED})


def logs_request(request: pb.StreamLogsRequest) -> LogQuery:
    """The request's ids and options checked (ValueError says what is wrong); the attempt
    is still as asked (0: the latest)."""
    if not is_valid_run_id(request.run_id):
        raise ValueError(f"not a run id: {request.run_id[:80]!r} (run ids look like "
                         "r-20261201-081500-a1b2c3)")
    if not is_valid_name(request.step):
        raise ValueError(f"not a step name: {request.step[:100]!r}")
    if not 0 <= request.attempt <= MAX_ATTEMPT:
        raise ValueError(f"attempt must be 1 or more (0: the latest), got {request.attempt}")
    if request.tail_bytes < 0:
        raise ValueError(f"tail_bytes must not be negative, got {request.tail_bytes}")
    return LogQuery(run_id=request.run_id, step=request.step, attempt=request.attempt,
                    streams=logfiles.parse_streams(request.stream), follow=request.follow,
                    tail_bytes=request.tail_bytes)


class _Unreachable(M27Error):
    """The node-agent is not there to relay from; the message says why."""


# ---------------------------------------------------------------- the servicer


class ClusterServicer(pb_grpc.ClusterServiceServicer):
    def __init__(self, store: RunStore, *, node_timeout: float, home: Path,
                 agents: ApiAccess, clock: Callable[[], float] = time.time,
                 poll_s: float = WAIT_POLL_S) -> None:
        """`agents`: how to call node-agents (a `node` token: all they accept)."""
        self.store = store
        self.agents = agents
        self.bus: Bus = store.bus
        self.node_timeout = node_timeout
        self.home = home
        self.clock = clock
        self.poll_s = poll_s

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_ClusterServiceServicer_to_server(self, server)

    # ------------------------------------------------------------ ListNodes

    async def ListNodes(self, request: pb.ListNodesRequest,
                        context: Context) -> pb.ListNodesResponse:
        nodes = await self._all(subjects.NODES_BUCKET, NodeInfo)
        booked = cpus_booked(await self._all(subjects.TASKS_BUCKET, _TaskEntry))
        now = self.clock()
        differ = live_differences(nodes, now=now, node_timeout=self.node_timeout)
        return pb.ListNodesResponse(nodes=[
            node_to_proto(n, now=now, node_timeout=self.node_timeout,
                          cpu_used=booked.get(n.node_id, 0),
                          differences=differ.get(n.node_id, ()))
            for n in sorted(nodes, key=lambda n: n.node_id)])

    async def _all(self, bucket: str, type_: type[T]) -> list[T]:
        """Every value in the bucket that decodes (a bad one is logged and skipped)."""
        keys = await self.bus.kv_keys(bucket)
        found = await asyncio.gather(*(self.bus.kv_get(bucket, k, type_) for k in keys),
                                     return_exceptions=True)
        values: list[T] = []
        for key, got in zip(keys, found, strict=True):
            if isinstance(got, msgspec.ValidationError | msgspec.DecodeError):
                log.warning("cluster.undecodable_entry", bucket=bucket, key=key,
                            error=str(got))
            elif isinstance(got, BaseException):
                raise got
            elif got is not None:
                values.append(got[0])
        return values

    # ------------------------------------------------------------ StreamLogs

    async def StreamLogs(self, request: pb.StreamLogsRequest,
                         context: Context) -> AsyncIterator[pb.LogChunk]:
        try:
            asked = logs_request(request)
        except ValueError as exc:
            await refuse(context, InvalidRequest(str(exc)))
        found = await self._locate(asked, context)
        query = msgspec.structs.replace(asked, attempt=found.attempt)
        sent: dict[str, int] = {}  # stream → the offset after what was relayed
        address = await self._agent_address(found.node_id)
        why = f"the node-agent of {found.node_id} is not running (it is not registered)"
        if address is not None:
            try:
                async for message in self._remote(address, found.node_id, query, sent,
                                                  context):
                    yield message
                return
            except _Unreachable as exc:
                why = str(exc)
        async for message in self._local(query, found.node_id, sent, why, context):
            yield message

    async def _locate(self, asked: LogQuery, context: Context) -> Found:
        """The attempt and its node; a follow of a step that has not started waits."""
        while True:
            run = await self._run(asked.run_id, context)
            found = find_attempt(run, asked.step, asked.attempt)
            if isinstance(found, Found):
                return found
            if not (asked.follow and found.waitable):
                await refuse(context, found.error())
            await asyncio.sleep(self.poll_s)

    async def _run(self, run_id: str, context: Context) -> RunRecord:
        try:
            stored, _ = await self.store.get(run_id)
        except NotFoundError:
            await refuse(context, NotFoundError(f"no run {run_id}"))
        problem = api_access.run_problem(caller(), stored.run.user, run_id, acting=False)
        if problem:
            await refuse(context, PermissionDenied(problem))
        return stored.run

    async def _agent_address(self, node_id: str) -> str | None:
        got = await self.bus.kv_get(subjects.SERVICES_BUCKET,
                                    subjects.service_key(NODE_AGENT_SERVICE, node_id),
                                    ServiceInfo)
        return got[0].grpc_address if got else None

    async def _remote(self, address: str, node_id: str, query: LogQuery,
                      sent: dict[str, int], context: Context) -> AsyncIterator[pb.LogChunk]:
        """The node-agent's TailLog, relayed; _Unreachable when it cannot be reached."""
        request = pb.TailLogRequest(task_id=task_id(query.run_id, query.step),
                                    attempt=query.attempt, stream=stream_name(query.streams),
                                    follow=query.follow, tail_bytes=query.tail_bytes)
        async with self.agents.channel(address, options=CLIENT_OPTIONS) as channel:
            call = pb_grpc.NodeServiceStub(channel).TailLog(request)
            try:
                async for message in call:
                    sent[message.stream] = message.offset + len(message.data)
                    yield message
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _UNREACHABLE:
                    raise _Unreachable(f"the node-agent of {node_id} at {address} cannot be "
                                       f"reached ({exc.details()})") from exc
                await abort(context, exc.code(), exc.details() or exc.code().name)

    async def _local(self, query: LogQuery, node_id: str, sent: dict[str, int], why: str,
                     context: Context) -> AsyncIterator[pb.LogChunk]:
        """The log files read here, when they are on this machine (one host)."""
        try:
            files = await asyncio.to_thread(logfiles.open_logs, self.home, query, sent)
        except logfiles.LogNotFound:
            where = logfiles.log_path(self.home, query.run_id, query.step, query.attempt,
                                      query.streams[0]).parent
            await refuse(context, Unavailable(
                f"{why}, and its logs are not on this machine (no {where}); they are on "
                f"node {node_id}"), metadata=(ERROR_ORIGIN,))
        except logfiles.LogError as exc:
            await refuse(context, Refused(str(exc)))
        log.info("logs.read_locally", node_id=node_id, task_id=task_id(query.run_id,
                                                                       query.step),
                 attempt=query.attempt, why=why)

        async def running() -> bool:
            return await self._attempt_running(query)

        try:
            async for chunk in logfiles.tail(files, follow=query.follow,
                                             still_running=running, poll_s=self.poll_s):
                yield chunk_to_proto(chunk)
        finally:
            logfiles.close_all(files)

    async def _attempt_running(self, query: LogQuery) -> bool:
        try:
            stored, _ = await self.store.get(query.run_id)
        except NotFoundError:
            return False
        step = stored.run.step(query.step)
        return step is not None and step.attempt == query.attempt and step.state == "running"
