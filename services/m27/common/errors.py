"""The one exception root of m27, and the few families under it.

Cores return failures as values; shells catch these at their boundary and turn them into
gRPC statuses or one-line CLI messages. Each family names the gRPC status a server ends an
RPC with when it is the reason (`status`, a `grpc.StatusCode` name): that is the one
mapping from errors to statuses, applied by `m27.common.grpc_server.refuse`.
"""

from typing import ClassVar


class M27Error(Exception):
    """Anything m27 reports to a user as a clear message rather than a traceback."""

    #: The request was understood, but the state of things does not allow it.
    status: ClassVar[str] = "FAILED_PRECONDITION"


class InvalidRequest(M27Error):
    """A request (or document) that is wrong in itself; the message says where."""

    status = "INVALID_ARGUMENT"


class OutOfRange(InvalidRequest):
    """A number past what it can be (a sequence beyond any stream's)."""

    status = "OUT_OF_RANGE"


class NotFoundError(M27Error):
    """An id (run, step, node, checkpoint) that does not exist."""

    status = "NOT_FOUND"


class Refused(M27Error):
    """A valid request the current state forbids (retry a run that succeeded, …)."""


class ResourceExhausted(M27Error):
    """Over a limit: too large, too many, a full disk."""

    status = "RESOURCE_EXHAUSTED"


class Unavailable(M27Error):
    """Something this depends on cannot be reached now; trying again later may work."""

    status = "UNAVAILABLE"


class DataLoss(M27Error):
    """Stored data is damaged (a checksum does not match)."""

    status = "DATA_LOSS"


class Internal(M27Error):
    """A failure of m27 itself; the log has the details."""

    status = "INTERNAL"


class Unauthenticated(M27Error):
    """A call that proves no identity: no token, a damaged or foreign one, an expired one."""

    status = "UNAUTHENTICATED"


class PermissionDenied(M27Error):
    """A known caller who may not do this (another user's run, an admin's action)."""

    status = "PERMISSION_DENIED"


class ConfigError(M27Error):
    """A configuration value is wrong; the message names the section and key."""


class BusError(Unavailable):
    """NATS could not be reached or refused an operation."""
