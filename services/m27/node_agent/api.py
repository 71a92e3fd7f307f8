"""`m27.v1.NodeService`: this node's own API. `TailLog` streams a task's log files.

The orchestrator's `StreamLogs` relays it; nothing else calls it. Files are found from
the agent's home and the ids alone (`m27.common.logfiles`); whether the attempt still runs here
comes from the runner, through the `is_running` callable.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Final

import grpc

from m27.common import logfiles
from m27.common.errors import InvalidRequest, NotFoundError, Refused
from m27.common.grpc_server import refuse
from m27.common.ids import split_task_id
from m27.common.logfiles import LogChunk, LogQuery
from m27.node_agent._runner import TaskRunner
from m27.v1 import cluster_pb2 as pb
from m27.v1 import cluster_pb2_grpc as pb_grpc

SERVICE_NAME: Final = "m27.v1.NodeService"
MAX_ATTEMPT: Final = 1_000_000

#: (task_id, attempt) → whether that attempt is running on this agent now.
IsRunning = Callable[[str, int], bool]
Context = grpc.aio.ServicerContext[object, object]


def nothing_running(task_id: str, attempt: int) -> bool:
    """Before the runner exists: every log is complete as it is."""
    return False


def running_check(runner: TaskRunner) -> IsRunning:
    """`is_running` for the runner's tasks: this exact attempt, still alive here."""
    def is_running(task_id: str, attempt: int) -> bool:
        return any(h.task_id == task_id and h.attempt == attempt
                   for h in runner.task_holdings())

    return is_running


def tail_query(request: pb.TailLogRequest) -> LogQuery:
    """The request as a LogQuery; ValueError with the reason when it is not valid."""
    run_id, step = split_task_id(request.task_id[:200])
    if not 1 <= request.attempt <= MAX_ATTEMPT:
        raise ValueError(f"attempt must be 1 or more, got {request.attempt}")
    if request.tail_bytes < 0:
        raise ValueError(f"tail_bytes must not be negative, got {request.tail_bytes}")
    return LogQuery(run_id=run_id, step=step, attempt=request.attempt,
                    streams=logfiles.parse_streams(request.stream), follow=request.follow,
                    tail_bytes=request.tail_bytes)


def chunk_to_proto(chunk: LogChunk) -> pb.LogChunk:
    return pb.LogChunk(stream=chunk.stream, data=chunk.data, offset=chunk.offset)


class NodeServicer(pb_grpc.NodeServiceServicer):
    def __init__(self, home: Path, node_id: str, is_running: IsRunning, *,
                 poll_s: float = logfiles.POLL_S) -> None:
        self.home = home
        self.node_id = node_id
        self.is_running = is_running
        self.poll_s = poll_s

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_NodeServiceServicer_to_server(self, server)

    async def TailLog(self, request: pb.TailLogRequest,
                      context: Context) -> AsyncIterator[pb.LogChunk]:
        try:
            query = tail_query(request)
        except ValueError as exc:
            await refuse(context, InvalidRequest(str(exc)))
        files = await self._open(query, context)

        async def running() -> bool:
            return self.is_running(request.task_id, request.attempt)

        try:
            async for chunk in logfiles.tail(files, follow=query.follow,
                                             still_running=running, poll_s=self.poll_s):
                yield chunk_to_proto(chunk)
        finally:
            logfiles.close_all(files)

    async def _open(self, query: LogQuery, context: Context) -> list[logfiles.LogFile]:
        try:
            return await asyncio.to_thread(logfiles.open_logs, self.home, query)
        except logfiles.LogNotFound as exc:
            what = "/".join(query.streams) if len(query.streams) == 1 else "stdout or stderr"
            await refuse(context, NotFoundError(
                f"node {self.node_id} has no {what} log of {query.run_id}/{query.step} "
                f"attempt {query.attempt} ({exc})"))
        except logfiles.LogError as exc:
            await refuse(context, Refused(str(exc)))
