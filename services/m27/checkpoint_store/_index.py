"""The manifest index: which checkpoints exist. A checkpoint exists exactly when its manifest
is here.

Production keeps manifests in the NATS KV bucket `subjects.CHECKPOINTS_BUCKET` under
`<run_id>.<step>.<checkpoint_id>` (JSON of `Manifest`; JetStream fsyncs it);
`MemoryManifestIndex` is the same contract in a dict, for unit tests and in-process use.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Final, Protocol

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from m27.checkpoint_store._ids import CheckpointRef, ref_from_key, shown, task_prefix
from m27.common import subjects
from m27.common.bus import NatsBus
from m27.common.checkpoint_api import CheckpointCorrupt, StorageUnavailable
from m27.common.checkpoint_format import Manifest
from m27.common.errors import BusError
from m27.common.logging import get_logger

log = get_logger()

_DECODER: Final = msgspec.json.Decoder(Manifest)
_DECODE_ERRORS: Final = (msgspec.DecodeError, msgspec.ValidationError)
_GET_BATCH: Final = 64
ALL_KEYS: Final = ">"
#: Compare-and-set tries before a retirement gives up (another writer won each time).
_CAS_TRIES: Final = 20
#: Manifests read together (`batches`).
Batch = list[Manifest]


class _Protection(msgspec.Struct):
    protected: str = ""


_PROTECTION: Final = msgspec.json.Decoder(_Protection)


def is_protected(value: bytes) -> bool:
    """Whether a stored manifest is protected (an unreadable one is not)."""
    try:
        return bool(_PROTECTION.decode(value).protected)
    except _DECODE_ERRORS:
        return False


class ManifestIndex(Protocol):
    """Two store copies may share one index: a manifest changes after its commit only
    through `protect` and `retire`, each a compare-and-set, so that a copy acting on what
    it listed a moment ago never undoes what the other copy did since."""

    async def put(self, manifest: Manifest) -> None:
        """Commit the manifest durably; after this the checkpoint is visible."""

    async def get(self, ref: CheckpointRef) -> Manifest | None: ...

    async def list(self, pattern: str, *, strict: bool = False) -> list[Manifest]:
        """Manifests whose keys match a NATS pattern (`task_prefix(...) + "*"`,
        `run_pattern(...)`, `ALL_KEYS`), in no particular order. An unreadable one is
        skipped (logged), or with `strict` raises CheckpointCorrupt: garbage collection
        must not sweep chunks because a manifest could not be read."""

    def batches(self, pattern: str, *, strict: bool = False) -> AsyncIterator[Batch]:
        """`list`, a batch at a time: garbage collection reads every manifest, and holding
        them all at once made the store's memory grow with everything it keeps."""

    async def delete(self, ref: CheckpointRef) -> None:
        """Remove the manifest; harmless when there is none."""

    async def protect(self, ref: CheckpointRef, reason: str) -> Manifest | None:
        """Mark the manifest protected with `reason` (one already protected keeps its
        reason), by compare-and-set; the manifest as stored after, or None when there is
        none: a manifest deleted meanwhile is never written back."""

    async def retire(self, ref: CheckpointRef) -> bool:
        """Delete the manifest unless it is protected, by compare-and-set (a `protect`
        that lands first wins); True if this call deleted it."""


def task_pattern(run_id: str, step: str) -> str:
    return f"{task_prefix(run_id, step)}*"


def ref_of(manifest: Manifest) -> CheckpointRef:
    run_id, _, step = manifest.task_id.partition("/")
    return CheckpointRef(run_id, step, manifest.checkpoint_id)


def decode_stored(key: str, value: bytes) -> Manifest:
    """A stored manifest, which must describe the key it is stored under."""
    ref = ref_from_key(key)
    try:
        manifest = _DECODER.decode(value)
    except _DECODE_ERRORS as exc:
        raise CheckpointCorrupt(f"the manifest stored as {shown(key)} is unreadable: {exc}") \
            from None
    if ref is None or ref_of(manifest) != ref:
        raise CheckpointCorrupt(
            f"the manifest stored as {shown(key)} describes {shown(manifest.task_id)} "
            f"{shown(manifest.checkpoint_id)}")
    return manifest


def _accept(key: str, value: bytes | None, *, strict: bool) -> Manifest | None:
    if value is None:
        return None
    try:
        return decode_stored(key, value)
    except CheckpointCorrupt as exc:
        if strict:
            raise
        log.warning("checkpoint.manifest_unreadable", key=key, error=str(exc))
        return None


@contextlib.contextmanager
def nats_errors(action: str) -> Iterator[None]:
    """A NATS failure as StorageUnavailable: the client may retry later."""
    try:
        yield
    except (nats.errors.Error, BusError, TimeoutError, ConnectionError) as exc:
        reason = str(exc) or type(exc).__name__
        raise StorageUnavailable(f"cannot {action}: NATS KV: {reason}") from exc


class KvManifestIndex:
    """Manifests in the checkpoints KV bucket."""

    def __init__(self, bus: NatsBus, bucket: str = subjects.CHECKPOINTS_BUCKET) -> None:
        self._bus = bus
        self._bucket = bucket

    async def put(self, manifest: Manifest) -> None:
        with nats_errors("commit a checkpoint manifest"):
            await self._bus.kv_put(self._bucket, ref_of(manifest).key, manifest)

    async def get(self, ref: CheckpointRef) -> Manifest | None:
        with nats_errors("read a checkpoint manifest"):
            kv = await self._bus.kv(self._bucket)
            try:
                entry = await kv.get(ref.key)
            except nats.js.errors.KeyNotFoundError:
                return None
        return None if entry.value is None else decode_stored(ref.key, entry.value)

    async def list(self, pattern: str, *, strict: bool = False) -> list[Manifest]:
        """The server filters the keys, so other tasks cost nothing."""
        return [m async for batch in self.batches(pattern, strict=strict) for m in batch]

    async def batches(self, pattern: str, *,
                      strict: bool = False) -> AsyncIterator[Batch]:
        with nats_errors("list checkpoint manifests"):
            keys = await self._bus.kv_keys(self._bucket, pattern)
            kv = await self._bus.kv(self._bucket)
        for start in range(0, len(keys), _GET_BATCH):
            batch = keys[start:start + _GET_BATCH]
            with nats_errors("list checkpoint manifests"):
                values = await asyncio.gather(*(self._value(kv, key) for key in batch))
            found = [_accept(key, value, strict=strict)
                     for key, value in zip(batch, values, strict=True)]
            yield [manifest for manifest in found if manifest is not None]

    @staticmethod
    async def _value(kv: KeyValue, key: str) -> bytes | None:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None  # deleted since it was listed
        return entry.value

    async def delete(self, ref: CheckpointRef) -> None:
        with nats_errors("delete a checkpoint manifest"):
            await self._bus.kv_delete(self._bucket, ref.key)

    async def protect(self, ref: CheckpointRef, reason: str) -> Manifest | None:
        def change(current: Manifest | None) -> Manifest | None:
            if current is None or current.protected:
                return None  # gone (never created again), or the first reason stays
            return msgspec.structs.replace(current, protected=reason)

        with nats_errors("protect a checkpoint manifest"):
            return await self._bus.kv_update(self._bucket, ref.key, Manifest, change)

    async def retire(self, ref: CheckpointRef) -> bool:
        with nats_errors("retire a checkpoint manifest"):
            kv = await self._bus.kv(self._bucket)
            for _ in range(_CAS_TRIES):
                try:
                    entry = await kv.get(ref.key)
                except nats.js.errors.KeyNotFoundError:
                    return False
                if entry.value is None or is_protected(entry.value):
                    return False
                try:  # its marker expires (bus.DELETE_MARKER_TTL_S): no key kept for good
                    await self._bus.kv_delete(self._bucket, ref.key, last=entry.revision)
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue  # changed since it was read: read it again
                return True
        raise StorageUnavailable(f"cannot retire checkpoint {ref.checkpoint_id}: its "
                                 "manifest kept changing")


def matches(pattern: str, key: str) -> bool:
    """NATS subject matching of a key against `*` / `>` patterns."""
    want, have = pattern.split("."), key.split(".")
    for index, part in enumerate(want):
        if part == ">":
            return len(have) > index
        if index >= len(have) or (part != "*" and part != have[index]):
            return False
    return len(want) == len(have)


class MemoryManifestIndex:
    """The same contract in memory (manifests kept as JSON, as in KV); not durable."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def put(self, manifest: Manifest) -> None:
        self.values[ref_of(manifest).key] = msgspec.json.encode(manifest)

    async def get(self, ref: CheckpointRef) -> Manifest | None:
        value = self.values.get(ref.key)
        return None if value is None else decode_stored(ref.key, value)

    async def list(self, pattern: str, *, strict: bool = False) -> list[Manifest]:
        found = [_accept(k, v, strict=strict) for k, v in list(self.values.items())
                 if matches(pattern, k)]
        return [manifest for manifest in found if manifest is not None]

    async def batches(self, pattern: str, *,
                      strict: bool = False) -> AsyncIterator[Batch]:
        found = await self.list(pattern, strict=strict)
        for start in range(0, len(found), _GET_BATCH):
            yield found[start:start + _GET_BATCH]

    async def delete(self, ref: CheckpointRef) -> None:
        self.values.pop(ref.key, None)

    async def protect(self, ref: CheckpointRef, reason: str) -> Manifest | None:
        value = self.values.get(ref.key)
        current = None if value is None else decode_stored(ref.key, value)
        if current is None or current.protected:
            return current
        protected = msgspec.structs.replace(current, protected=reason)
        self.values[ref.key] = msgspec.json.encode(protected)
        return protected

    async def retire(self, ref: CheckpointRef) -> bool:
        value = self.values.get(ref.key)
        if value is None or is_protected(value):
            return False
        del self.values[ref.key]
        return True
