"""The checkpoint-store's domain types: a validated Put header and the committed record.

`CheckpointRecord` is what the KV bucket holds (JSON). Schema evolution: add fields with
defaults only; `layout` says how the blob is stored, so a later chunked/compressed layout
can live beside plain blobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec

from m27.checkpoint_store._errors import CheckpointCorrupt, InvalidCheckpointRequest
from m27.checkpoint_store._ids import CheckpointRef, parse_task_id, shown

MAX_NAME_CHARS: Final = 200
MAX_METADATA_ENTRIES: Final = 64
MAX_METADATA_BYTES: Final = 64 * 1024
PLAIN_LAYOUT: Final = "plain"


class Header(msgspec.Struct, frozen=True, kw_only=True):
    """A Put's header after validation: the task is well formed, the labels are bounded."""

    run_id: str
    step: str
    attempt: int
    name: str = ""
    metadata: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def task_id(self) -> str:
        return f"{self.run_id}/{self.step}"


class CheckpointRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One committed checkpoint; it exists (for List and Get) exactly when this is in KV."""

    task_id: str
    checkpoint_id: str
    attempt: int
    name: str
    size_bytes: int
    sha256: str
    created_at: float
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    layout: str = PLAIN_LAYOUT

    @property
    def ref(self) -> CheckpointRef:
        run_id, _, step = self.task_id.partition("/")
        return CheckpointRef(run_id, step, self.checkpoint_id)


def validate_header(*, task_id: str, attempt: int, name: str,
                    metadata: Mapping[str, str]) -> Header:
    """The header as a `Header`; InvalidCheckpointRequest naming the first problem."""
    run_id, step = parse_task_id(task_id)
    if attempt < 0:
        raise InvalidCheckpointRequest(f"attempt must be 0 or more, got {attempt}")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidCheckpointRequest(
            f"name must be at most {MAX_NAME_CHARS} characters, got {len(name)}")
    _check_metadata(metadata)
    return Header(run_id=run_id, step=step, attempt=attempt, name=name,
                  metadata=dict(metadata))


def _check_metadata(metadata: Mapping[str, str]) -> None:
    """Bounded, so a record always fits comfortably in one KV value."""
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidCheckpointRequest(
            f"metadata may have at most {MAX_METADATA_ENTRIES} entries, got {len(metadata)}")
    if any(not key for key in metadata):
        raise InvalidCheckpointRequest("metadata keys must not be empty")
    total = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())
    if total > MAX_METADATA_BYTES:
        raise InvalidCheckpointRequest(
            f"metadata may hold at most {MAX_METADATA_BYTES} bytes of keys and values, "
            f"got {total}")


def check_record(record: CheckpointRecord, ref: CheckpointRef) -> CheckpointRecord:
    """A record read back under `ref` must describe `ref`; anything else is corruption."""
    if record.ref != ref:
        raise CheckpointCorrupt(
            f"the record stored for {ref.task_id} {ref.checkpoint_id} describes "
            f"{shown(record.task_id)} {shown(record.checkpoint_id)}")
    return record
