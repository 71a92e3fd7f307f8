"""The checkpoint-store's exception family, one root under `M27Error`.

The servicer turns each family into one gRPC status (see `_servicer.STATUS_CODES`), so a
client always gets a clear message and never a traceback.
"""

from __future__ import annotations

from m27.common.errors import M27Error, NotFoundError


class CheckpointStoreError(M27Error):
    """Anything the checkpoint-store reports to a client; unexpected ones become INTERNAL."""


class InvalidCheckpointRequest(CheckpointStoreError):
    """A request that can never succeed as sent: bad ids, bad header, bad stream shape."""


class CheckpointNotFound(CheckpointStoreError, NotFoundError):
    """No committed checkpoint with that task and id."""


class CheckpointTooLarge(CheckpointStoreError):
    """A Put carried more bytes than the store accepts for one checkpoint."""


class CheckpointCorrupt(CheckpointStoreError):
    """Stored bytes no longer match their record: the data is lost, not merely missing."""


class StorageError(CheckpointStoreError):
    """The disk refused an operation (permissions, I/O error)."""


class StorageFull(StorageError):
    """The disk holding the checkpoints is full."""


class StorageUnavailable(CheckpointStoreError):
    """The record index (NATS KV) could not be reached; retrying later may succeed."""


class BlobMissing(CheckpointStoreError):
    """A blob file is not there; the store decides whether that is NOT_FOUND or DATA_LOSS."""


class StaleAttempt(CheckpointStoreError):
    """A write from an attempt that is no longer the task's assigned one (its node was
    declared lost and a newer attempt runs elsewhere): refused, never stored."""
