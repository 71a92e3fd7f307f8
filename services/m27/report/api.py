"""`m27.v1.ReportService`: a run's training metrics from the history store, served by the
report service.

Protobuf stays here. Who may read a run's metrics is the same rule as for the run itself
(`api_access.run_problem`): its owner, an admin, a service. The owner comes from the
orchestrator's record (`OwnerOf`), remembered for the runs asked about lately.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Final

import grpc

from m27.common import api_access
from m27.common.api_auth import caller
from m27.common.curves import Curve, points_asked
from m27.common.errors import InvalidRequest, M27Error, NotFoundError, PermissionDenied
from m27.common.grpc_server import Register, refuse
from m27.common.ids import is_valid_run_id
from m27.report.store import History
from m27.v1 import report_pb2 as pb
from m27.v1 import report_pb2_grpc as pb_grpc

SERVICE_NAME: Final = "m27.v1.ReportService"
MAX_FILTERS: Final = 1000  # steps or names in one request
MAX_SERIES: Final = 2000  # series in one answer (a sweep of 200 steps × 10 metrics)
OWNERS_KEPT: Final = 4096

#: The user a run belongs to (NotFoundError when the orchestrator does not know it).
OwnerOf = Callable[[str], Awaitable[str]]
Context = grpc.aio.ServicerContext[object, object]


def curve_to_proto(curve: Curve) -> pb.MetricSeries:
    message = pb.MetricSeries(step=curve.step, name=curve.name, steps=curve.steps,
                              values=curve.values, count=curve.count, last=curve.last,
                              last_step=curve.last_step, last_at=curve.last_at,
                              has_range=curve.min is not None)
    if curve.min is not None and curve.max is not None:
        message.min, message.min_step = curve.min
        message.max, message.max_step = curve.max
    return message


class ReportServicer(pb_grpc.ReportServiceServicer):
    def __init__(self, history: History, owner_of: OwnerOf) -> None:
        self.history = history
        self._owner_of = owner_of
        self._owners: OrderedDict[str, str] = OrderedDict()

    async def GetMetrics(self, request: pb.GetMetricsRequest,
                         context: Context) -> pb.GetMetricsResponse:
        run_id = request.run_id
        if not is_valid_run_id(run_id):
            await refuse(context, InvalidRequest(
                f"not a run id: {run_id[:80]!r} (run ids look like r-20261201-081500-a1b2c3)"))
        if len(request.steps) > MAX_FILTERS or len(request.names) > MAX_FILTERS:
            await refuse(context, InvalidRequest(
                f"at most {MAX_FILTERS} steps and {MAX_FILTERS} metric names per request"))
        try:
            owner = await self.owner(run_id)
        except M27Error as exc:
            await refuse(context, exc)
        problem = api_access.run_problem(caller(), owner, run_id, acting=False)
        if problem:
            await refuse(context, PermissionDenied(problem))
        curves = await asyncio.to_thread(self.history.curves, run_id,
                                         steps=set(request.steps), names=set(request.names),
                                         max_points=points_asked(request.max_points),
                                         limit=MAX_SERIES)
        return pb.GetMetricsResponse(series=[curve_to_proto(c) for c in curves])

    async def owner(self, run_id: str) -> str:
        """The run's user, from the orchestrator the first time (NotFoundError if none)."""
        owner = self._owners.get(run_id)
        if owner is None:
            try:
                owner = await self._owner_of(run_id)
            except NotFoundError:
                raise NotFoundError(f"no run {run_id}") from None
            self._owners[run_id] = owner
            if len(self._owners) > OWNERS_KEPT:
                self._owners.popitem(last=False)
        self._owners.move_to_end(run_id)
        return owner


def register(servicer: ReportServicer) -> Register:
    """A `Register` callback for `ServiceRuntime.serve_grpc`."""

    def add(server: grpc.aio.Server) -> None:
        pb_grpc.add_ReportServiceServicer_to_server(servicer, server)

    return add
