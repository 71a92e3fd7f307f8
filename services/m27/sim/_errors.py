"""The simulator's exceptions: one root under `M27Error`, so the CLI prints one line."""

from __future__ import annotations

from m27.common.errors import M27Error


class SimError(M27Error):
    """A simulation cannot run as asked (unknown policy, empty cluster, ...)."""


class TraceError(SimError):
    """A trace file is wrong; the message names the file, the line and what is wrong."""
