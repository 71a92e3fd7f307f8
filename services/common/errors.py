"""The one exception root of m27, and the few families under it.

Cores return failures as values; shells catch these at their boundary and turn them into
gRPC statuses or one-line CLI messages.
"""


class M27Error(Exception):
    """Anything m27 reports to a user as a clear message rather than a traceback."""


class ConfigError(M27Error):
    """A configuration value is wrong; the message names the section and key."""


class BusError(M27Error):
    """NATS could not be reached or refused an operation."""


class NotFoundError(M27Error):
    """An id (run, step, checkpoint) that does not exist."""
