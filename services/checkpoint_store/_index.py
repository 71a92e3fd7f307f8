"""The record index: which checkpoints exist. A checkpoint exists exactly when its record does.

Production keeps records in the NATS KV bucket `subjects.CHECKPOINTS_BUCKET` under
`<run_id>.<step>.<checkpoint_id>` (JSON); `MemoryRecordIndex` is the same contract in a
dict, for unit tests and in-process use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final, Protocol

import msgspec
import nats.errors
import nats.js.errors

from m27.checkpoint_store._errors import CheckpointCorrupt, StorageUnavailable
from m27.checkpoint_store._ids import CheckpointRef, ref_from_key, task_prefix
from m27.checkpoint_store._model import CheckpointRecord, check_record
from m27.common import subjects
from m27.common.bus import Bus
from m27.common.logging import get_logger

log = get_logger()

_DECODE_ERRORS: Final = (msgspec.DecodeError, msgspec.ValidationError)


class RecordIndex(Protocol):
    async def put(self, record: CheckpointRecord) -> None:
        """Commit the record durably; after this the checkpoint is visible."""

    async def get(self, ref: CheckpointRef) -> CheckpointRecord | None: ...

    async def list(self, run_id: str, step: str) -> list[CheckpointRecord]:
        """Every record of one task, in no particular order."""

    async def delete(self, ref: CheckpointRef) -> None:
        """Remove the record; harmless when there is none."""


@contextlib.contextmanager
def nats_errors(action: str) -> Iterator[None]:
    """A NATS failure as StorageUnavailable: the client may retry later."""
    try:
        yield
    except (nats.errors.Error, TimeoutError, ConnectionError) as exc:
        reason = str(exc) or type(exc).__name__
        raise StorageUnavailable(f"cannot {action}: NATS KV: {reason}") from exc


class KvRecordIndex:
    """Records in the checkpoints KV bucket (JetStream, fsynced by the server)."""

    def __init__(self, bus: Bus, bucket: str = subjects.CHECKPOINTS_BUCKET) -> None:
        self._bus = bus
        self._bucket = bucket

    async def put(self, record: CheckpointRecord) -> None:
        with nats_errors("commit a checkpoint record"):
            await self._bus.kv_put(self._bucket, record.ref.key, record)

    async def get(self, ref: CheckpointRef) -> CheckpointRecord | None:
        with nats_errors("read a checkpoint record"):
            try:
                found = await self._bus.kv_get(self._bucket, ref.key, CheckpointRecord)
            except _DECODE_ERRORS as exc:
                raise CheckpointCorrupt(
                    f"the record of {ref.task_id} {ref.checkpoint_id} is unreadable: {exc}"
                ) from None
        return None if found is None else check_record(found[0], ref)

    async def list(self, run_id: str, step: str) -> list[CheckpointRecord]:
        """One task's records; the server filters the keys, so other tasks cost nothing."""
        records: list[CheckpointRecord] = []
        with nats_errors("list checkpoint records"):
            for key in await self._bus.kv_keys(self._bucket, f"{task_prefix(run_id, step)}*"):
                kv = await self._bus.kv(self._bucket)
                try:
                    entry = await kv.get(key)
                except nats.js.errors.KeyNotFoundError:
                    continue  # deleted since it was listed
                record = _decode_entry(key, entry.value)
                if record is not None:
                    records.append(record)
        return records

    async def delete(self, ref: CheckpointRef) -> None:
        with nats_errors("delete a checkpoint record"):
            await self._bus.kv_delete(self._bucket, ref.key)


def _decode_entry(key: str, value: bytes | None) -> CheckpointRecord | None:
    """A listed record, or None (logged) for one that cannot be trusted."""
    ref = ref_from_key(key)
    if ref is None or value is None:
        return None
    try:
        return check_record(msgspec.json.decode(value, type=CheckpointRecord), ref)
    except (*_DECODE_ERRORS, CheckpointCorrupt) as exc:
        log.warning("checkpoint.record_unreadable", key=key, error=str(exc))
        return None


class MemoryRecordIndex:
    """The same contract in memory (records kept as JSON, as in KV); not durable."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def put(self, record: CheckpointRecord) -> None:
        self.values[record.ref.key] = msgspec.json.encode(record)

    async def get(self, ref: CheckpointRef) -> CheckpointRecord | None:
        value = self.values.get(ref.key)
        if value is None:
            return None
        return check_record(msgspec.json.decode(value, type=CheckpointRecord), ref)

    async def list(self, run_id: str, step: str) -> list[CheckpointRecord]:
        prefix = task_prefix(run_id, step)
        found = [_decode_entry(k, v) for k, v in self.values.items() if k.startswith(prefix)]
        return [record for record in found if record is not None]

    async def delete(self, ref: CheckpointRef) -> None:
        self.values.pop(ref.key, None)
