"""The checkpoint store: chunks on a directory, manifests in an index, and the rules between.

A checkpoint is visible exactly when its manifest is in the index, and the manifest is
written only after every chunk it references is on disk and fsynced (PutChunks returns
only then; Commit checks again). A crash at any point therefore leaves the previous
checkpoint intact: at worst some unreferenced chunks, which garbage collection removes.
Decisions (manifest validation, retention, mark/sweep) are pure functions elsewhere; this
module applies them. Blocking file I/O runs in threads; the event loop only waits.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import weakref
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Sequence,
)
from typing import Final

import msgspec

from m27.checkpoint_store._chunks import ChunkStore
from m27.checkpoint_store._ids import (
    CheckpointRef,
    checkpoint_id_ms,
    new_checkpoint_id,
    next_id_ms,
    parse_chunk_ids,
    parse_ref,
    parse_run_id,
    parse_task_id,
    run_pattern,
)
from m27.checkpoint_store._index import ALL_KEYS, ManifestIndex, ref_of, task_pattern
from m27.checkpoint_store._manifests import decode_manifest, seal, stored_sizes
from m27.checkpoint_store._retention import (
    DEFAULT_GRACE_S,
    RetentionPolicy,
    choose_protected,
    choose_retained,
    mark,
    removal_time,
    sweep,
)
from m27.common import events
from m27.common.checkpoint_api import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointSummary,
    CheckpointTooLarge,
    ChunksMissing,
    InvalidCheckpointRequest,
    StaleAttempt,
    StorageUnavailable,
    summarize,
)
from m27.common.checkpoint_format import Manifest
from m27.common.logging import get_logger

log = get_logger()

DEFAULT_MAX_BYTES: Final = 64 * 1024**3
MAX_IDS_PER_REQUEST: Final = 65536
WRITES_IN_FLIGHT: Final = 4
READS_AHEAD: Final = 2
SHOWN_IDS: Final = 5
#: A protection's reason is kept to this many characters (one line).
MAX_REASON: Final = 500
#: Protect chooses again when the checkpoint it chose was retired meanwhile (by another
#: copy of the store); after this many tries it gives up.
PROTECT_TRIES: Final = 8

OnCorrupt = Callable[[events.CheckpointCorrupt], Awaitable[None]]
OnCommit = Callable[[events.CheckpointCommitted], Awaitable[None]]
AssignedAttempt = Callable[[str], Awaitable[int | None]]
#: When a run ended (unix time), None while it has not or when it is unknown.
RunEnded = Callable[[str], Awaitable[float | None]]


class PutResult(msgspec.Struct, frozen=True):
    received: int
    stored: int
    stored_bytes: int


class CommitResult(msgspec.Struct, frozen=True):
    manifest: Manifest
    deleted: tuple[str, ...]


class GcReport(msgspec.Struct, frozen=True, kw_only=True):
    manifests: int
    expired: int  # manifests removed: their run ended more than keep_finished ago
    referenced: int
    young: int
    deleted: int
    freed_bytes: int
    temp_removed: int


def upload_limit(max_bytes: int) -> int:
    """Stored bytes one upload may carry: `max_bytes` is about decoded sizes (checked
    exactly at Commit), and incompressible chunks come out of zstd a little larger."""
    return max_bytes + max_bytes // 64 + 1024 * 1024


def _token() -> str:
    return secrets.token_hex(3)


def _check_attempt(attempt: int) -> int:
    if attempt < 0:
        raise InvalidCheckpointRequest(f"attempt must be 0 or more, got {attempt}")
    return attempt


class CheckpointStore:
    """MissingChunks, PutChunks, Commit, GetManifest, GetChunks, List, Delete and GC."""

    def __init__(self, chunks: ChunkStore, index: ManifestIndex, *,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 retention: RetentionPolicy | None = None,
                 gc_grace_s: float = DEFAULT_GRACE_S,
                 keep_finished_s: float = 0.0,
                 run_ended: RunEnded | None = None,
                 clock: Callable[[], float] = time.time,
                 token: Callable[[], str] = _token,
                 assigned_attempt: AssignedAttempt | None = None,
                 on_corrupt: OnCorrupt | None = None,
                 on_commit: OnCommit | None = None) -> None:
        self.chunks = chunks
        self._index = index
        self.max_bytes = max_bytes
        self.retention = retention or RetentionPolicy()
        self.gc_grace_s = gc_grace_s
        self.keep_finished_s = keep_finished_s
        self._run_ended = run_ended
        #: run_id → when it ended, for runs GC found ended and not yet due: their records
        #: (up to megabytes each) are read again only once due (a retry may have reopened
        #: the run meanwhile), not every round.
        self._ended: dict[str, float] = {}
        self._clock = clock
        self._token = token
        self._assigned_attempt = assigned_attempt
        self._on_corrupt = on_corrupt
        self._on_commit = on_commit
        self._last_ms = 0
        self._task_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = \
            weakref.WeakValueDictionary()

    async def prepare(self) -> int:
        """Ready the directory (run once before serving); returns temp files removed."""
        return await asyncio.to_thread(self.chunks.prepare, temp_older_than_s=self.gc_grace_s)

    async def _fence(self, task_id: str, attempt: int) -> None:
        """Only the attempt the scheduler assigned (or a newer one) may write."""
        if self._assigned_attempt is None:
            return
        assigned = await self._assigned_attempt(task_id)
        if assigned is not None and attempt < assigned:
            raise StaleAttempt(f"attempt {attempt} of {task_id} is stale: "
                               f"attempt {assigned} is the assigned one")

    async def missing(self, task_id: str, attempt: int, ids: Sequence[str]) -> list[str]:
        """Which of `ids` the store lacks; fenced when a task is named."""
        chunk_ids = parse_chunk_ids(ids, MAX_IDS_PER_REQUEST)
        if task_id:
            parse_task_id(task_id)
            await self._fence(task_id, _check_attempt(attempt))
        return await asyncio.to_thread(self.chunks.missing, chunk_ids)

    async def put_chunks(self, task_id: str, attempt: int,
                         chunks: AsyncIterable[tuple[str, bytes]]) -> PutResult:
        """Store each chunk (verified, durable) of a fenced attempt's upload."""
        parse_task_id(task_id)
        await self._fence(task_id, _check_attempt(attempt))
        pending: set[asyncio.Future[bool]] = set()
        sizes: dict[asyncio.Future[bool], int] = {}
        received = stored = stored_bytes = total = 0

        def count(done: Iterable[asyncio.Future[bool]]) -> None:
            nonlocal stored, stored_bytes
            for task in done:
                if task.result():
                    stored, stored_bytes = stored + 1, stored_bytes + sizes[task]

        try:
            async for chunk_id, data in chunks:
                parse_chunk_ids([chunk_id], 1)
                total += len(data)
                if total > upload_limit(self.max_bytes):
                    raise CheckpointTooLarge(f"a checkpoint may be at most {self.max_bytes} "
                                             "bytes; this upload is larger")
                while len(pending) >= WRITES_IN_FLIGHT:
                    done, pending = await asyncio.wait(pending,
                                                       return_when=asyncio.FIRST_COMPLETED)
                    count(done)
                write = asyncio.ensure_future(asyncio.to_thread(self.chunks.put, chunk_id, data))
                pending.add(write)
                sizes[write] = len(data)
                received += 1
            await asyncio.gather(*pending)
            count(pending)
        finally:
            if pending:  # a failed upload: let the writes in flight finish first
                await asyncio.wait(pending)
                for task in pending:
                    if not task.cancelled():
                        task.exception()  # retrieved: only the first failure is reported
        return PutResult(received, stored, stored_bytes)

    def _lock(self, task_id: str) -> asyncio.Lock:
        lock = self._task_locks.get(task_id)
        if lock is None:
            lock = self._task_locks[task_id] = asyncio.Lock()
        return lock

    async def commit(self, task_id: str, attempt: int, manifest_json: bytes | str) -> CommitResult:
        """Make a checkpoint visible once every chunk it needs is stored, then apply
        retention to the task."""
        run_id, step = parse_task_id(task_id)
        await self._fence(task_id, _check_attempt(attempt))
        manifest = await asyncio.to_thread(decode_manifest, manifest_json, task_id=task_id,
                                           attempt=attempt, max_bytes=self.max_bytes)
        sizes = stored_sizes(manifest)
        problems = await asyncio.to_thread(self.chunks.problems, sizes, touch=True)
        if problems:
            shown = ", ".join(f"{c[:12]} ({why})" for c, why in list(problems.items())[:SHOWN_IDS])
            raise ChunksMissing(f"{len(problems)} of the checkpoint's {len(sizes)} chunks are "
                                f"not stored: {shown}; upload them first",
                                tuple(sorted(problems)))
        async with self._lock(task_id):
            existing = await self._index.list(task_pattern(run_id, step))
            previous = max(existing, key=lambda m: m.checkpoint_id, default=None)
            await self._fence(task_id, attempt)  # the task may have moved meanwhile
            sealed = seal(manifest, checkpoint_id=self._new_id(previous), now=self._clock(),
                          seq=(previous.seq if previous else 0) + 1, previous=previous)
            await self._index.put(sealed)
            deleted = await self._apply_retention([*existing, sealed])
        await self._announce(sealed)
        return CommitResult(sealed, deleted)

    async def _announce(self, sealed: Manifest) -> None:
        """Tell the scheduler (best effort: the checkpoint is durable and visible already;
        a lost event only makes a preemption choice less informed)."""
        if self._on_commit is None:
            return
        try:
            await self._on_commit(events.CheckpointCommitted(
                at=self._clock(), task_id=sealed.task_id, attempt=sealed.attempt,
                checkpoint_id=sealed.checkpoint_id, step=sealed.step,
                size_bytes=sealed.size_bytes, new_bytes=sealed.new_bytes))
        except Exception as exc:
            log.warning("checkpoint.commit_unannounced", checkpoint_id=sealed.checkpoint_id,
                        error=str(exc) or type(exc).__name__)

    def _new_id(self, previous: Manifest | None = None) -> str:
        """A new id, later than this store's last one and than `previous`, the task's
        newest checkpoint: that one may come from another copy of the store, whose clock
        (or burst of commits) is ahead, and ids must sort in commit order (latest,
        retention)."""
        floor = checkpoint_id_ms(previous.checkpoint_id) if previous is not None else 0
        self._last_ms = next_id_ms(int(self._clock() * 1000), max(self._last_ms, floor))
        return new_checkpoint_id(self._last_ms, self._token())

    async def _apply_retention(self, manifests: list[Manifest]) -> tuple[str, ...]:
        """Delete what retention does not keep; a failure here never fails the commit."""
        decision = choose_retained([summarize(m) for m in manifests], self.retention)
        by_id = {m.checkpoint_id: m for m in manifests}
        deleted = []
        for checkpoint_id in decision.delete:
            manifest = by_id[checkpoint_id]
            try:
                retired = await self._index.retire(parse_ref(manifest.task_id, checkpoint_id))
            except StorageUnavailable as exc:
                log.warning("checkpoint.retention_failed", checkpoint_id=checkpoint_id,
                            error=str(exc))
                break
            if not retired:  # protected or deleted since it was listed (another copy)
                continue
            deleted.append(checkpoint_id)
            log.info("checkpoint.retired", task_id=manifest.task_id,
                     checkpoint_id=checkpoint_id, reason=decision.reasons[checkpoint_id])
        return tuple(deleted)

    async def get_manifest(self, task_id: str,
                           checkpoint_id: str = "") -> tuple[Manifest, list[str]]:
        """One manifest, or with an empty id the latest good one and the ids of newer
        checkpoints passed over because a chunk is missing or damaged."""
        if checkpoint_id:
            ref = parse_ref(task_id, checkpoint_id)
            found = await self._index.get(ref)
            if found is None:
                raise CheckpointNotFound(f"task {task_id} has no checkpoint {checkpoint_id}")
            return found, []
        run_id, step = parse_task_id(task_id)
        newest_first = sorted(await self._index.list(task_pattern(run_id, step)),
                              key=lambda m: m.checkpoint_id, reverse=True)
        if not newest_first:
            raise CheckpointNotFound(f"task {task_id} has no checkpoints")
        damaged: list[tuple[Manifest, str, str]] = []
        for manifest in newest_first:
            problems = await asyncio.to_thread(self.chunks.problems, stored_sizes(manifest))
            if not problems:
                await self._report(damaged, manifest.checkpoint_id)
                return manifest, [m.checkpoint_id for m, _, _ in damaged]
            chunk_id, why = min(problems.items())
            damaged.append((manifest, chunk_id, why))
        await self._report(damaged, "")
        raise CheckpointCorrupt(f"every checkpoint of {task_id} has missing or damaged chunks "
                                f"(the latest: chunk {damaged[0][1]}, {damaged[0][2]})")

    async def _report(self, damaged: list[tuple[Manifest, str, str]],
                      fell_back_to: str) -> None:
        for manifest, chunk_id, why in damaged:
            log.error("checkpoint.damaged", task_id=manifest.task_id,
                      checkpoint_id=manifest.checkpoint_id, chunk_id=chunk_id, reason=why,
                      fell_back_to=fell_back_to)
            if self._on_corrupt is None:
                continue
            event = events.CheckpointCorrupt(
                at=self._clock(), task_id=manifest.task_id,
                checkpoint_id=manifest.checkpoint_id, chunk_id=chunk_id,
                fell_back_to=fell_back_to, reason=why)
            try:
                await self._on_corrupt(event)
            except Exception as exc:  # the restore matters more than the event
                log.warning("checkpoint.event_not_published", error=str(exc))

    async def get_chunks(self, ids: Sequence[str]) -> AsyncIterator[tuple[str, bytes]]:
        """The chunks in order, each verified, with the next reads already under way."""
        chunk_ids = parse_chunk_ids(ids, MAX_IDS_PER_REQUEST)
        ahead: list[asyncio.Future[bytes]] = []
        position = 0
        try:
            while position < len(chunk_ids):
                while len(ahead) < READS_AHEAD and position + len(ahead) < len(chunk_ids):
                    next_id = chunk_ids[position + len(ahead)]
                    ahead.append(asyncio.ensure_future(
                        asyncio.to_thread(self.chunks.read, next_id)))
                data = await ahead.pop(0)
                yield chunk_ids[position], data
                position += 1
        finally:
            for future in ahead:
                future.cancel()
            await asyncio.gather(*ahead, return_exceptions=True)

    async def list(self, task_id: str = "", run_id: str = "", *,
                   with_removal: bool = False) -> list[CheckpointSummary]:
        """One task's (or one run's) checkpoints, oldest first; `with_removal` fills in when
        GC removes them, at one read of each listed run's record."""
        if bool(task_id) == bool(run_id):
            raise InvalidCheckpointRequest("List takes exactly one of task_id and run_id")
        if task_id:
            pattern = task_pattern(*parse_task_id(task_id))
        else:
            pattern = run_pattern(parse_run_id(run_id))
        found = await self._index.list(pattern)
        removal: dict[str, float | None] = {}
        for run_id in {ref_of(m).run_id for m in found} if with_removal else ():
            removal[run_id] = await self._removed_at(run_id)
        return [msgspec.structs.replace(summarize(m), removed_at=removal.get(ref_of(m).run_id))
                for m in sorted(found, key=lambda m: (m.task_id, m.checkpoint_id))]

    async def _removed_at(self, run_id: str) -> float | None:
        """When GC removes the run's checkpoints (`keep_finished` after it ended)."""
        if self._run_ended is None or self.keep_finished_s <= 0:
            return None
        return removal_time(await self._run_ended(run_id), self.keep_finished_s)

    async def protect(self, task_id: str, attempt: int, before_step: int | None,
                      before: float, reason: str) -> str:
        """Keep the task's last checkpoint from before a training anomaly out of retention
        (`choose_protected`); its id, or "" when there is none. Fenced like a commit."""
        run_id, step = parse_task_id(task_id)
        await self._fence(task_id, _check_attempt(attempt))
        reason = " ".join(reason.split())[:MAX_REASON] or "protected"
        async with self._lock(task_id):
            for _ in range(PROTECT_TRIES):
                existing = await self._index.list(task_pattern(run_id, step))
                chosen = choose_protected([summarize(m) for m in existing], before_step,
                                          before)
                if chosen is None:
                    return ""
                # a compare-and-set (the first anomaly's reason stays): a checkpoint that
                # another copy's retention removed since the listing stays removed
                ref = parse_ref(task_id, chosen.checkpoint_id)
                if await self._index.protect(ref, reason) is not None:
                    return chosen.checkpoint_id
        raise StorageUnavailable(f"cannot protect a checkpoint of {task_id}: they kept "
                                 "being retired meanwhile; try again")

    async def delete(self, task_id: str, checkpoint_id: str) -> bool:
        """Forget one checkpoint (its chunks go at the next GC); False if there was none."""
        ref: CheckpointRef = parse_ref(task_id, checkpoint_id)
        existed = await self._index.get(ref) is not None
        await self._index.delete(ref)
        return existed

    async def collect_garbage(self) -> GcReport:
        """Remove the manifests of runs that ended more than `keep_finished_s` ago, mark
        every chunk the other manifests reference, sweep the rest once past the grace
        period. An unreadable manifest stops the sweep: its chunks might be needed."""
        marked_at = self._clock()
        # A batch of manifests at a time, and the chunk files as they are listed: what a
        # round holds is the set of referenced chunk ids, not every manifest and file
        # the store keeps (holding those made its memory grow with what it stores).
        referenced: set[str] = set()
        expired_runs: dict[str, bool] = {}
        manifests = expired = 0
        async for batch in self._index.batches(ALL_KEYS, strict=True):
            kept = []
            for manifest in batch:
                if await self._expired(manifest, expired_runs, marked_at):
                    await self._index.delete(ref_of(manifest))
                    expired += 1
                else:
                    kept.append(manifest)
            mark(kept, referenced)
            manifests += len(batch)
        self._ended = {run: at for run, at in self._ended.items() if run in expired_runs}
        decision = await asyncio.to_thread(lambda: sweep(
            self.chunks.files(), referenced, marked_at=marked_at, grace_s=self.gc_grace_s))
        deleted = await asyncio.to_thread(self._delete_chunks, decision.delete, decision.cutoff)
        temp = await asyncio.to_thread(self.chunks.remove_temp_files, decision.cutoff)
        return GcReport(manifests=manifests, expired=expired, referenced=decision.referenced,
                        young=decision.young, deleted=len(deleted),
                        freed_bytes=sum(decision.sizes[c] for c in deleted), temp_removed=temp)

    async def _expired(self, manifest: Manifest, runs: dict[str, bool], now: float) -> bool:
        """Whether the manifest's run ended more than keep_finished ago (decided once per
        run and round: `runs`). A run known to have ended is asked about again only once
        it is due, then afresh: a retry may have reopened it meanwhile."""
        if self._run_ended is None or self.keep_finished_s <= 0:
            return False
        run_id = ref_of(manifest).run_id
        if run_id in runs:
            return runs[run_id]
        runs[run_id] = False
        known = removal_time(self._ended.get(run_id), self.keep_finished_s)
        if known is not None and now < known:
            return False  # ended, not due yet
        ended_at = await self._run_ended(run_id)
        removed_at = removal_time(ended_at, self.keep_finished_s)
        if ended_at is None or removed_at is None:
            self._ended.pop(run_id, None)  # going (again), or unknown: kept
            return False
        self._ended[run_id] = ended_at
        if now >= removed_at:
            log.info("checkpoint.run_expired", run_id=run_id, removed_at=removed_at,
                     keep_finished_s=self.keep_finished_s)
            runs[run_id] = True
        return runs[run_id]

    def _delete_chunks(self, chunk_ids: Sequence[str], cutoff: float) -> Sequence[str]:
        deleted = [c for c in chunk_ids if self.chunks.delete_if_older(c, cutoff)]
        self.chunks.sync_prefixes({c[:2] for c in deleted})
        return deleted
