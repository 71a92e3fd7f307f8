"""The client of the report service's API (`m27.v1.ReportService`): a run's training
metrics as `Curve`s.

    async with ReportClient("127.0.0.1:50055") as report:
        for curve in await report.metrics("r-20261201-081500-a1b2c3", names=["loss"]):
            ...
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import grpc

from m27.common.api_auth import ApiAccess, default_access
from m27.common.curves import Curve
from m27.common.errors import M27Error, NotFoundError
from m27.common.grpc_server import CLIENT_OPTIONS
from m27.v1 import report_pb2 as pb
from m27.v1 import report_pb2_grpc as pb_grpc


class ReportError(M27Error):
    """The report service could not be reached or refused the call."""


class RunUnknown(ReportError, NotFoundError):
    """The orchestrator does not know the run."""


def curve_from_proto(message: pb.MetricSeries) -> Curve:
    has = message.has_range
    return Curve(step=message.step, name=message.name, steps=tuple(message.steps),
                 values=tuple(message.values), count=message.count, last=message.last,
                 last_step=message.last_step, last_at=message.last_at,
                 min=(message.min, message.min_step) if has else None,
                 max=(message.max, message.max_step) if has else None)


class ReportClient:
    def __init__(self, address: str, *, access: ApiAccess | None = None,
                 timeout: float = 30.0) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = (access or default_access()).channel(address, options=CLIENT_OPTIONS)
        self._stub = pb_grpc.ReportServiceStub(self._channel)

    async def __aenter__(self) -> ReportClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self._channel.close(None)

    async def metrics(self, run_id: str, *, steps: Sequence[str] = (),
                      names: Sequence[str] = (), max_points: int = 0) -> list[Curve]:
        """Every curve of the run (or of these steps and metric names), thinned to
        `max_points` each (0: the service's default)."""
        request = pb.GetMetricsRequest(run_id=run_id, steps=steps, names=names,
                                       max_points=max_points)
        try:
            reply = await self._stub.GetMetrics(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        return [curve_from_proto(s) for s in reply.series]

    def _error(self, exc: grpc.aio.AioRpcError) -> ReportError:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            return ReportError(f"cannot reach the report service at {self.address}: is it "
                               "up? (`m27 status` shows it)")
        if code == grpc.StatusCode.NOT_FOUND:
            return RunUnknown(details)
        return ReportError(details or f"the report service refused the call "
                           f"({code.name.lower()})")
