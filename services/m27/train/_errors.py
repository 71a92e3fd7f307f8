"""The exception root of the training library."""

from __future__ import annotations

from m27.common.errors import M27Error


class TrainError(M27Error):
    """Anything the training library reports to the program that uses it."""


class CheckpointError(TrainError):
    """A checkpoint could not be taken or made durable (the message says why)."""


class RestoreError(TrainError):
    """A checkpoint could not be restored into this model/optimizer."""
