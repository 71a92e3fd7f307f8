"""Runs in JetStream KV: compare-and-set updates and the outbox that follows each of them.

Every change goes through `mutate`: read the run and its revision, apply a pure core
function, write the result only if nobody wrote in between (else retry on fresh data), then
publish the outbox and clear it. Messages carry stable ids, so JetStream drops the copies a
crash-and-retry would send again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Callable
from typing import Final

import msgspec
import nats.js.errors

from m27.common import subjects
from m27.common.bus import NatsBus
from m27.common.errors import M27Error, NotFoundError
from m27.common.logging import get_logger
from m27.orchestrator.runs import StoredRun, without_published

log = get_logger()

MAX_CAS_ATTEMPTS: Final = 50
_encoder: Final = msgspec.json.Encoder()
_decoder: Final = msgspec.json.Decoder(StoredRun)

Mutation = Callable[[StoredRun], StoredRun | None]


class RunExistsError(M27Error):
    pass


class RunStore:
    def __init__(self, bus: NatsBus) -> None:
        self.bus = bus
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def create(self, stored: StoredRun) -> None:
        """Store a new run (fails if the id exists), then publish its first messages."""
        kv = await self.bus.kv(subjects.RUNS_BUCKET)
        async with self._locks[stored.run.run_id]:
            try:
                revision = await kv.create(stored.run.run_id, _encoder.encode(stored))
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                raise RunExistsError(stored.run.run_id) from exc
            await self._flush(stored, revision)

    async def get(self, run_id: str) -> tuple[StoredRun, int]:
        kv = await self.bus.kv(subjects.RUNS_BUCKET)
        try:
            entry = await kv.get(run_id)
        except nats.js.errors.KeyNotFoundError as exc:
            raise NotFoundError(f"no run {run_id!r}") from exc
        if entry.value is None or entry.revision is None:
            raise NotFoundError(f"no run {run_id!r}")
        return _decoder.decode(entry.value), entry.revision

    async def run_ids(self) -> list[str]:
        return await self.bus.kv_keys(subjects.RUNS_BUCKET)

    async def mutate(self, run_id: str, change: Mutation) -> StoredRun:
        """Apply `change` with compare-and-set; returns the run as stored afterwards."""
        kv = await self.bus.kv(subjects.RUNS_BUCKET)
        async with self._locks[run_id]:
            for _ in range(MAX_CAS_ATTEMPTS):
                stored, revision = await self.get(run_id)
                updated = change(stored)
                if updated is None:
                    if stored.outbox:  # left over from a crash: finish the job now
                        return await self._flush(stored, revision)
                    return stored
                try:
                    revision = await kv.update(run_id, _encoder.encode(updated), last=revision)
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue
                return await self._flush(updated, revision)
        raise M27Error(f"run {run_id}: too many concurrent updates")

    async def _flush(self, stored: StoredRun, revision: int) -> StoredRun:
        """Publish the outbox in order, then remove what was published from the record."""
        if not stored.outbox:
            return stored
        for outgoing in stored.outbox:
            await self.bus.publish(outgoing.subject, outgoing.message, msg_id=outgoing.msg_id)
        published = [o.msg_id for o in stored.outbox]
        kv = await self.bus.kv(subjects.RUNS_BUCKET)
        for _ in range(MAX_CAS_ATTEMPTS):
            cleared = without_published(stored, published)
            try:
                await kv.update(stored.run.run_id, _encoder.encode(cleared), last=revision)
                return cleared
            except nats.js.errors.KeyWrongLastSequenceError:
                stored, revision = await self.get(stored.run.run_id)
        return stored

    async def recover(self) -> int:
        """Publish outboxes a crashed orchestrator left behind; returns how many runs had one."""
        count = 0
        for run_id in await self.run_ids():
            with contextlib.suppress(NotFoundError):
                stored, _ = await self.get(run_id)
                if stored.outbox:
                    await self.mutate(run_id, lambda _s: None)
                    count += 1
        if count:
            log.info("runs.recovered_outboxes", runs=count)
        return count
