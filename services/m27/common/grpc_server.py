"""Every gRPC server of m27 is built here: health checking and server reflection included."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from m27.common.admission import Admission
from m27.common.api_access import METHOD_ROLES
from m27.common.api_auth import Authenticator, Keys, server_credentials
from m27.common.config import ApiSection
from m27.common.decoding import RequestDecoding
from m27.common.errors import M27Error
from m27.common.outages import BusOutages
from m27.common.tokens import ApiRole

MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
#: A status message as sent (percent-encoded). It travels in the trailers, and gRPC clients
#: drop a call whose metadata passes 16 KiB ("Stream removed", RESOURCE_EXHAUSTED): an
#: error that echoes a huge input would hide itself.
MAX_STATUS_MESSAGE_BYTES: Final = 8 * 1024
#: The health service name that answers SERVING while the process runs and its server
#: answers, ready or not: liveness. The whole server ("") and each named service say
#: SERVING only once the service is ready — a scheduler standby never is until it acts.
LIVE_SERVICE: Final = "m27.live"
#: Calls a server handles at once (streams included); the next ones are refused with
#: RESOURCE_EXHAUSTED (`m27.common.admission`).
MAX_CONCURRENT_RPCS: Final = 1000
#: gRPC core's queue of calls not yet taken by the server: past its default (1,000) core
#: cancels them with a bare CANCELLED; raised so that admission decides instead.
MAX_PENDING_CALLS: Final = 100_000
SERVER_OPTIONS: Final = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]
CLIENT_OPTIONS: Final = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

Register = Callable[[grpc.aio.Server], None]


def status_of(error: BaseException) -> grpc.StatusCode:
    """The gRPC status for `error`: an `M27Error` family's `status`; anything else is a bug
    of ours (INTERNAL). The one mapping from errors to statuses (`m27.common.errors`)."""
    if isinstance(error, M27Error):
        return grpc.StatusCode[error.status]
    return grpc.StatusCode.INTERNAL


def fitted(message: str, limit: int = MAX_STATUS_MESSAGE_BYTES) -> str:
    """`message` cut to at most `limit` bytes as gRPC sends it (percent-encoded: any byte
    but printable ASCII takes three), with what was cut said at the end."""
    used = 0
    for index, char in enumerate(message):
        used += 1 if " " <= char <= "~" and char != "%" else 3 * len(
            char.encode("utf-8", "surrogatepass"))
        if used > limit - 40:
            return f"{message[:index]}… ({len(message) - index} more characters)"
    return message


async def abort(context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode,
                message: str, *, metadata: Sequence[tuple[str, str]] = ()) -> NoReturn:
    """End the call with `code` and a sentence for the user (cut to fit: `fitted`);
    servicers call `refuse`, this is for relaying a status another server gave."""
    await context.abort(code, fitted(message), trailing_metadata=tuple(metadata))
    raise AssertionError("context.abort raises")


async def refuse(context: grpc.aio.ServicerContext[Any, Any], error: M27Error, *,
                 metadata: Sequence[tuple[str, str]] = ()) -> NoReturn:
    """End the call with `error`'s status and its message, a sentence for the user (every
    servicer's refusals)."""
    await abort(context, status_of(error), str(error), metadata=metadata)


class GrpcServer:
    """A started aio server with its bound address; health is NOT_SERVING until `serving()`."""

    def __init__(self, server: grpc.aio.Server, address: str, health: HealthServicer,
                 service_names: Sequence[str]) -> None:
        self.server = server
        self.address = address
        self.health = health
        self.service_names = tuple(service_names)

    async def serving(self) -> None:
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        """Not ready (again); still alive."""
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float = 2.0) -> None:
        for name in ("", LIVE_SERVICE, *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)


async def start_server(bind: str, registrations: Sequence[Register],
                       service_names: Sequence[str], *, keys: Keys,
                       api: ApiSection | None = None,
                       max_calls: int = MAX_CONCURRENT_RPCS,
                       method_roles: Mapping[str, frozenset[ApiRole]] = METHOD_ROLES
                       ) -> GrpcServer:
    """Bind `bind` (`host:port`, port 0 picks a free one), add health and reflection, start;
    at most `max_calls` calls at once (then RESOURCE_EXHAUSTED); every call but a health
    check needs a token `keys` verify, over TLS or loopback as `api` says
    (`m27.common.api_auth`)."""
    credentials = server_credentials(bind, api or ApiSection())
    server = grpc.aio.server(options=SERVER_OPTIONS,
                             interceptors=[Authenticator(keys, table=method_roles),
                                           Admission(max_calls),
                                           BusOutages(), RequestDecoding()])
    for register in registrations:
        register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("", *service_names):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME),
        server,
    )
    try:
        port = server.add_secure_port(bind, credentials)
    except RuntimeError as exc:
        raise M27Error(f"cannot listen for gRPC on {bind}: {exc}") from exc
    if port == 0:
        raise M27Error(f"cannot listen for gRPC on {bind}: address in use or not local")
    await server.start()
    await health.set(LIVE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    host = bind.rsplit(":", 1)[0] or "127.0.0.1"
    if host in {"0.0.0.0", "[::]", "::"}:  # noqa: S104 - reporting, not binding
        host = "127.0.0.1"
    return GrpcServer(server, f"{host}:{port}", health, service_names)
