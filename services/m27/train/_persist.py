"""The persister thread: hash, delta, compress and upload a snapshot, then commit its
manifest — all off the training loop, at a lowered CPU priority.

Chunks are uploaded entry by entry (only those the store is missing) and the manifest is
committed last, so a crash at any point leaves the previous checkpoint the latest one.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Final, Literal

import msgspec
import zstandard

from m27.common.checkpoint_format import (
    CHUNK_BYTES,
    ChunkRef,
    Entry,
    Manifest,
    chain_depth,
    decode_chunk,
    plan_entry,
)
from m27.common.checkpoint_storage import CheckpointSink
from m27.train._crew import Crew, WorkList
from m27.train._policy import delta_pays
from m27.train._snapshot import HostBuffers, Snapshot, TensorRef, wait_readable
from m27.train._state import dtype_name

DeltaBase = Literal["memory", "store", "off"]
Priority = Literal["idle"] | int
FORMAT: Final = "m27.train/1"
ALIGN: Final = 64  # packed tensors start on 64-byte boundaries (any dtype view is legal)
Done = Callable[[Snapshot, Manifest | None, BaseException | None], None]


def without_deltas(entry: Entry | None) -> Entry | None:
    """`entry` with its delta chunks made unmatchable, for a full checkpoint: unchanged
    plain chunks are still kept, delta chunks are encoded afresh without a base."""
    if entry is None or all(ref.base is None for ref in entry.chunks):
        return entry
    chunks = tuple(ref if ref.base is None else
                   ChunkRef(id=ref.id, raw_sha256="", length=ref.length, stored=ref.stored,
                            codec="zstd") for ref in entry.chunks)
    return msgspec.structs.replace(entry, chunks=chunks)


class Persister:
    def __init__(self, store: CheckpointSink, buffers: HostBuffers, done: Done, *,
                 task_id: str, attempt: int, compression_level: int, diff_threshold: int,
                 delta_base: DeltaBase, nice: Priority, threads: int = 1,
                 durable_within: float | None = None) -> None:
        self.store, self.buffers, self._done = store, buffers, done
        self.task_id, self.attempt = task_id, attempt
        self.level, self.diff_threshold, self.delta_base = (
            compression_level, diff_threshold, delta_base)
        self.nice = nice
        self.previous: Manifest | None = None  # the last committed checkpoint
        self._plain: dict[str, int] = {}  # stored bytes of an entry encoded without deltas
        self._no_delta: set[str] = set()  # deltas did not pay since the last full one
        self.durable_within = durable_within
        self._local = threading.local()
        self._crew = Crew(threads - 1, self._lower_priority)
        self._queue: queue.Queue[Snapshot | Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="m27-ckpt-persist",
                                        daemon=True)
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        self._queue.put(snapshot)

    def later(self, job: Callable[[], None]) -> None:
        """Run `job` on this (low-priority) thread, e.g. preparing buffers."""
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._crew.close()

    def _lower_priority(self) -> None:
        """Linux scheduling is per thread: "idle" (SCHED_IDLE) runs this thread only on a
        core nothing else wants, so it never delays one of torch's threads for a time
        slice; a number is a nice value (lower priority, but a fair share)."""
        with contextlib.suppress(OSError, AttributeError):
            if self.nice == "idle":
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            elif self.nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)

    def _compressor(self) -> zstandard.ZstdCompressor:
        found: zstandard.ZstdCompressor | None = getattr(self._local, "zstd", None)
        if found is None:  # one per thread: a compressor is not thread-safe
            found = self._local.zstd = zstandard.ZstdCompressor(level=self.level)
        return found

    def _run(self) -> None:
        self._lower_priority()
        while (snapshot := self._queue.get()) is not None:
            if not isinstance(snapshot, Snapshot):
                with contextlib.suppress(Exception):
                    snapshot()
                continue
            try:
                manifest: Manifest | None = self.persist(snapshot)
                error: BaseException | None = None
            except Exception as exc:
                manifest, error = None, exc
            self._done(snapshot, manifest, error)

    def persist(self, snapshot: Snapshot) -> Manifest:
        if snapshot.error is not None:
            raise snapshot.error
        wait_readable(snapshot)
        previous = {e.name: e for e in self.previous.entries} if self.previous else {}
        full = snapshot.kind.full
        if full:
            self._no_delta.clear()
        table, packed = [], bytearray()
        big = []
        for ref in snapshot.refs:
            ref.source = None  # the live tensor is no longer needed
            info: dict[str, object] = {"dtype": dtype_name(ref.dtype), "shape": list(ref.shape)}
            if ref.packed:
                packed.extend(bytes(-len(packed) % ALIGN))
                info["packed"] = [len(packed), ref.nbytes]
                packed.extend(_view(ref))
            else:
                info["entry"] = ref.name
                big.append(ref)
            table.append(info)
        snapshot.skeleton["tensors"] = table
        work = WorkList(big, lambda r: self._tensor(r, previous.get(r.name), full))
        results = self._crew.run(work, self._help_after(snapshot))
        snapshot.helped = work.helped
        entries = [entry for entry, _ in results]
        new_bytes = sum(added for _, added in results)
        for name, blob in (("packed", packed),
                           ("meta", msgspec.json.encode(snapshot.skeleton))):
            entry, added = self._plan(name, "bytes", memoryview(blob), previous.get(name),
                                      delta=False)
            entries.append(entry)
            new_bytes += added
        return self.store.commit(self._manifest(snapshot, entries, new_bytes))

    def _help_after(self, snapshot: Snapshot) -> float | None:
        """When the normal-priority helper joins: at once for a requested checkpoint,
        else once it has taken `durable_within` seconds since after_step."""
        if snapshot.urgent:
            return 0.0
        if self.durable_within is None:
            return None
        return self.durable_within - (time.perf_counter() - snapshot.started)

    def _tensor(self, ref: TensorRef, previous: Entry | None, full: bool) -> tuple[Entry, int]:
        if ref.reuse and previous is not None and previous.size == ref.nbytes and \
                (not full or all(c.base is None for c in previous.chunks)):
            return previous, 0  # unchanged since the last checkpoint: nothing to do
        delta = not full and self.delta_base != "off" and previous is not None and \
            ref.nbytes >= self.diff_threshold and ref.name not in self._no_delta
        entry, added = self._plan(
            ref.name, "tensor", _view(ref), previous if not full else without_deltas(previous),
            delta=delta, previous_raw=self._previous_raw(ref, previous) if delta else None,
            dtype=dtype_name(ref.dtype), shape=ref.shape)
        stored = sum(c.stored for c in entry.chunks)
        if not delta:
            self._plain[ref.name] = stored
        elif not delta_pays(stored, self._plain.get(ref.name)):
            self._no_delta.add(ref.name)  # plain until the next full checkpoint
        return entry, added

    def _previous_raw(self, ref: TensorRef, previous: Entry | None
                      ) -> Callable[[int], bytes] | None:
        if self.delta_base == "memory" and ref.base is not None:
            base = ref.base.numpy().data
            return lambda i: bytes(base[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
        if self.delta_base == "store" and previous is not None:
            unzip = zstandard.ZstdDecompressor()
            chunks = previous.chunks
            return lambda i: decode_chunk(chunks[i], self.store.read_chunk, unzip)
        return None

    def _plan(self, name: str, kind: Literal["tensor", "bytes"], data: memoryview,
              previous: Entry | None, *, delta: bool,
              previous_raw: Callable[[int], bytes] | None = None, dtype: str = "",
              shape: tuple[int, ...] = ()) -> tuple[Entry, int]:
        entry, new = plan_entry(name, kind, data, previous, delta=delta,
                                compressor=self._compressor(), previous_raw=previous_raw,
                                dtype=dtype, shape=shape)
        return entry, self._upload(new)

    def _upload(self, chunks: dict[str, bytes]) -> int:
        if not chunks:
            return 0
        missing = self.store.missing(list(chunks))
        if missing:
            self.store.put_chunks({cid: chunks[cid] for cid in chunks if cid in missing})
        return sum(len(chunks[cid]) for cid in missing)

    def _manifest(self, snapshot: Snapshot, entries: list[Entry], new_bytes: int) -> Manifest:
        return Manifest(
            task_id=self.task_id, attempt=self.attempt, name=f"step-{snapshot.step}",
            created_at=snapshot.created_at, step=snapshot.step, epoch=snapshot.epoch,
            cursor=dict(snapshot.cursor), entries=tuple(entries), full=snapshot.kind.full,
            chain=snapshot.kind.chain, metadata={"format": FORMAT, "reason": snapshot.reason},
            size_bytes=sum(e.size for e in entries), new_bytes=new_bytes)


def _view(ref: TensorRef) -> memoryview:
    assert ref.data is not None
    return ref.data.numpy().data if ref.nbytes else memoryview(b"")


def max_chain(manifest: Manifest) -> int:
    """The longest delta chain a restore of `manifest` decodes."""
    return max((chain_depth(c) for e in manifest.entries for c in e.chunks), default=0)
