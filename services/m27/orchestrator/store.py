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
#: How often runs whose outbox could not be published are tried again (`flush_left`).
FLUSH_RETRY_S: Final = 2.0
_encoder: Final = msgspec.json.Encoder()
_decoder: Final = msgspec.json.Decoder(StoredRun)

Mutation = Callable[[StoredRun], StoredRun | None]


class RunExistsError(M27Error):
    pass


class RunStore:
    def __init__(self, bus: NatsBus) -> None:
        self.bus = bus
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        #: Runs whose change may be stored with its outbox not yet published: a publish
        #: or the write itself failed (NATS electing a leader, a reconnect). Without a
        #: retry such a run would wait for the next event about it, or for a restart.
        self.unflushed: set[str] = set()

    async def create(self, stored: StoredRun) -> None:
        """Store a new run (fails if the id exists), then publish its first messages."""
        kv = await self.bus.kv(subjects.RUNS_BUCKET)
        async with self._locks[stored.run.run_id]:
            try:
                revision = await kv.create(stored.run.run_id, _encoder.encode(stored))
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                raise RunExistsError(stored.run.run_id) from exc
            except Exception:
                self.unflushed.add(stored.run.run_id)  # stored after all? (a lost ack)
                raise
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
                except Exception:
                    self.unflushed.add(run_id)
                    raise
                return await self._flush(updated, revision)
        raise M27Error(f"run {run_id}: too many concurrent updates")

    async def _flush(self, stored: StoredRun, revision: int) -> StoredRun:
        """Publish the outbox in order, then remove what was published from the record.
        A publish that fails leaves the outbox (and the run in `unflushed`) for later."""
        if not stored.outbox:
            return stored
        try:
            for outgoing in stored.outbox:
                await self.bus.publish(outgoing.subject, outgoing.message,
                                       msg_id=outgoing.msg_id)
        except Exception as exc:
            # The change is stored, so it stands: its messages go out from `flush_loop`.
            self.unflushed.add(stored.run.run_id)
            log.warning("runs.outbox_deferred", run_id=stored.run.run_id,
                        messages=len(stored.outbox), error=str(exc) or type(exc).__name__,
                        retry_in_s=FLUSH_RETRY_S)
            return stored
        published = [o.msg_id for o in stored.outbox]
        kv = await self.bus.kv(subjects.RUNS_BUCKET)
        for _ in range(MAX_CAS_ATTEMPTS):
            cleared = without_published(stored, published)
            try:
                await kv.update(stored.run.run_id, _encoder.encode(cleared), last=revision)
                return cleared
            except nats.js.errors.KeyWrongLastSequenceError:
                stored, revision = await self.get(stored.run.run_id)
            except Exception:  # published, not yet cleared: sent again (same ids) later
                self.unflushed.add(stored.run.run_id)
                raise
        return stored

    async def flush_left(self) -> int:
        """Publish the outboxes of `unflushed` runs (a no-op change flushes); returns how
        many are still left (NATS still unavailable)."""
        for run_id in sorted(self.unflushed):
            try:
                stored = await self.mutate(run_id, lambda _s: None)
            except NotFoundError:  # the write that failed had not stored it
                self.unflushed.discard(run_id)
            except Exception as exc:  # tried again after FLUSH_RETRY_S
                log.warning("runs.outbox_unpublished", run_id=run_id,
                            error=str(exc) or type(exc).__name__)
            else:
                if not stored.outbox:
                    self.unflushed.discard(run_id)
                    log.info("runs.outbox_published", run_id=run_id)
        return len(self.unflushed)

    async def flush_loop(self, stop: asyncio.Event) -> None:
        """`flush_left` every FLUSH_RETRY_S while some run needs it, until `stop`."""
        while not stop.is_set():
            if self.unflushed:
                await self.flush_left()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), FLUSH_RETRY_S)

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
