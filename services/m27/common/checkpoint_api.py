"""The checkpoint-store's contract with its clients: error kinds, summaries, and the
protobuf ↔ domain conversions (shared by the service, its clients, the CLI, the node-agent
and the training library — so none of them imports another's package).

Every error a store call can raise is a `CheckpointStoreError`; the servicer ends the RPC
with its class's `status` (`m27.common.errors`) and sends its kind as trailing metadata
(`m27-error`), and `rpc_error` turns a gRPC error back into the same class, so client code
catches the same exceptions as server code raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final

import grpc
import msgspec

from m27.common.checkpoint_format import CorruptChunk, Manifest
from m27.common.errors import M27Error, NotFoundError
from m27.v1 import checkpoint_pb2 as pb

ERROR_KIND_KEY: Final = "m27-error"


class CheckpointStoreError(M27Error):
    """Anything the checkpoint-store reports to a client; unexpected ones become INTERNAL."""

    kind: ClassVar[str] = "error"
    status = "INTERNAL"


class InvalidCheckpointRequest(CheckpointStoreError):
    """A request that can never succeed as sent: bad ids, a bad manifest, a bad stream."""

    kind = "invalid"
    status = "INVALID_ARGUMENT"


class CheckpointNotFound(CheckpointStoreError, NotFoundError):
    """No committed checkpoint with that task and id."""

    kind = "not_found"
    status = "NOT_FOUND"


class CheckpointTooLarge(CheckpointStoreError):
    """More bytes than the store accepts for one checkpoint (`[checkpoint] max_size`)."""

    kind = "too_large"
    status = "RESOURCE_EXHAUSTED"


class CheckpointCorrupt(CheckpointStoreError, CorruptChunk):
    """Stored bytes no longer match their id: the data is lost, not merely missing. Also a
    `checkpoint_format.CorruptChunk`, so a restore handles both the same way."""

    kind = "chunk_corrupt"
    status = "DATA_LOSS"


class ChunkMissing(CheckpointCorrupt):
    """A chunk asked for (or that a checkpoint needs) is not in the store."""

    kind = "chunk_missing"
    status = "NOT_FOUND"


class ChunksMissing(CheckpointStoreError):
    """A Commit referenced chunks that were never uploaded (or were collected since)."""

    kind = "chunks_missing"
    status = "FAILED_PRECONDITION"

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class StaleAttempt(CheckpointStoreError):
    """A write from an attempt that is no longer the task's assigned one (its node was
    declared lost and a newer attempt runs elsewhere): refused, never stored."""

    kind = "stale_attempt"
    status = "FAILED_PRECONDITION"


class StorageError(CheckpointStoreError):
    """The disk refused an operation (permissions, I/O error)."""

    kind = "storage"
    status = "INTERNAL"


class StorageFull(StorageError):
    """The disk holding the checkpoints is full."""

    kind = "storage_full"
    status = "RESOURCE_EXHAUSTED"


class StorageUnavailable(CheckpointStoreError):
    """The manifest index (NATS KV) or the store itself could not be reached; retrying
    later may succeed."""

    kind = "unavailable"
    status = "UNAVAILABLE"


#: Every kind a client may see, to raise the server's class on its side.
ERRORS_BY_KIND: Final[dict[str, type[CheckpointStoreError]]] = {
    cls.kind: cls for cls in (
        CheckpointStoreError, InvalidCheckpointRequest, CheckpointNotFound,
        CheckpointTooLarge, CheckpointCorrupt, ChunkMissing, ChunksMissing, StaleAttempt,
        StorageError, StorageFull, StorageUnavailable)
}


class CheckpointSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One line of `List`: what a person or a retention rule needs, without the entries."""

    task_id: str
    checkpoint_id: str
    attempt: int
    name: str
    step: int | None
    epoch: int | None
    created_at: float
    size_bytes: int
    new_bytes: int
    full: bool
    entries: int
    seq: int = 0
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    protected: str = ""  # why retention keeps it whatever else it says ("" none)
    #: When it goes with the rest of its run's: the run's end + `[checkpoint] keep_finished`
    #: (None while the run goes on, or when they are kept for ever).
    removed_at: float | None = None


def summarize(manifest: Manifest) -> CheckpointSummary:
    return CheckpointSummary(
        task_id=manifest.task_id, checkpoint_id=manifest.checkpoint_id,
        attempt=manifest.attempt, name=manifest.name, step=manifest.step,
        epoch=manifest.epoch, created_at=manifest.created_at, size_bytes=manifest.size_bytes,
        new_bytes=manifest.new_bytes, full=manifest.full, entries=len(manifest.entries),
        seq=manifest.seq, metadata=dict(manifest.metadata), protected=manifest.protected)





_MANIFEST: Final = msgspec.json.Decoder(Manifest)
_STORED: Final = msgspec.json.Decoder(Manifest)
#: When a status carries no `m27-error` kind (another server, a proxy): the class its code
#: most likely stands for, read from the classes' own `status`.
_GUESSED: Final[tuple[type[CheckpointStoreError], ...]] = (
    InvalidCheckpointRequest, CheckpointNotFound, CheckpointTooLarge, CheckpointCorrupt,
    StorageUnavailable, StaleAttempt)
_BY_CODE: Final[dict[grpc.StatusCode, type[CheckpointStoreError]]] = {
    grpc.StatusCode[cls.status]: cls for cls in _GUESSED
} | {grpc.StatusCode.DEADLINE_EXCEEDED: StorageUnavailable}


def summary_to_proto(summary: CheckpointSummary) -> pb.CheckpointSummary:
    message = pb.CheckpointSummary(
        task_id=summary.task_id, checkpoint_id=summary.checkpoint_id, attempt=summary.attempt,
        name=summary.name, created_at=summary.created_at, size_bytes=summary.size_bytes,
        new_bytes=summary.new_bytes, full=summary.full, entries=summary.entries,
        seq=summary.seq, metadata=summary.metadata, protected=summary.protected)
    if summary.step is not None:
        message.step = summary.step
    if summary.epoch is not None:
        message.epoch = summary.epoch
    if summary.removed_at is not None:
        message.removed_at = summary.removed_at
    return message


def summary_from_proto(message: pb.CheckpointSummary) -> CheckpointSummary:
    return CheckpointSummary(
        task_id=message.task_id, checkpoint_id=message.checkpoint_id,
        attempt=message.attempt, name=message.name,
        step=message.step if message.HasField("step") else None,
        epoch=message.epoch if message.HasField("epoch") else None,
        created_at=message.created_at, size_bytes=message.size_bytes,
        new_bytes=message.new_bytes, full=message.full, entries=message.entries,
        seq=message.seq, metadata=dict(message.metadata), protected=message.protected,
        removed_at=message.removed_at if message.HasField("removed_at") else None)


def manifest_json(manifest: Manifest) -> str:
    return msgspec.json.encode(manifest).decode()


def manifest_from_json(text: str) -> Manifest:
    """A manifest the store sent; CheckpointStoreError if it is not one."""
    try:
        return _STORED.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointStoreError(f"checkpoint-store sent an unreadable manifest: {exc}") \
            from None


def error_metadata(exc: CheckpointStoreError) -> tuple[tuple[str, str], ...]:
    return ((ERROR_KIND_KEY, exc.kind),)


def error_from_status(code: grpc.StatusCode, details: str | None,
                      trailing: Sequence[tuple[str, str | bytes]] | None) -> CheckpointStoreError:
    """The exception a failed call stands for: the server's own class when it said."""
    kind = next((str(v) for k, v in trailing or () if k == ERROR_KIND_KEY), "")
    cls = ERRORS_BY_KIND.get(kind) or _BY_CODE.get(code, CheckpointStoreError)
    return cls(f"checkpoint-store: {details or code.name.lower().replace('_', ' ')}")


def rpc_error(exc: grpc.RpcError) -> CheckpointStoreError:
    """A failed sync or async call (both are `grpc.Call`s) as the store's exception."""
    call: grpc.Call = exc  # type: ignore[assignment]
    return error_from_status(call.code(), call.details(), call.trailing_metadata())
