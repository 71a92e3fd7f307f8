"""The persister: hash, encode and upload a snapshot, then commit its manifest — all off
the training loop.

A snapshot's large tensors are cut into chunks (4 MiB) and every chunk is hashed, encoded
and written by whichever crew thread takes it (`_crew.py`), so one large tensor is spread
over all of them and writing overlaps encoding. The manifest is committed last, so a
crash at any point leaves the previous checkpoint the latest one.

How a changed chunk is stored (see `checkpoint_format`): raw, or zstd / xor-zstd where
compression makes the checkpoint durable sooner (`compression_pays`, from the encode and
write rates measured as it goes: dense float32 state is written raw to a local disk);
`compress="always"` keeps the store smallest, `"never"` skips the measuring. Deltas are
against the last *full* checkpoint, so a restore decodes at most one delta over a full
chunk, whatever `keep_full_every` is.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec
import zstandard

from m27.common.checkpoint_format import (
    CHUNK_BYTES,
    ChunkRef,
    Entry,
    Manifest,
    Payload,
    chain_depth,
    decode_chunk,
    encode_chunk,
    plan_entry,
    sha256,
)
from m27.common.checkpoint_storage import CheckpointSink
from m27.train._crew import Crew, WorkList
from m27.train._policy import compression_pays, delta_pays
from m27.train._snapshot import HostBuffers, Snapshot, TensorRef, wait_readable
from m27.train._state import dtype_name

DeltaBase = Literal["memory", "store", "off"]
Compress = Literal["auto", "always", "never"]
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


class Rates:
    """Encode and write throughput (bytes/s), smoothed over the chunks seen."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.encode: float | None = None
        self.write: float | None = None
        self._lock = threading.Lock()

    def note(self, which: Literal["encode", "write"], nbytes: int, seconds: float) -> None:
        if nbytes < 64 * 1024 or seconds <= 0:
            return  # too small to time
        rate = nbytes / seconds
        with self._lock:
            old = getattr(self, which)
            setattr(self, which, rate if old is None else
                    old + self.weight * (rate - old))


@dataclass
class Pending:
    """One large tensor's entry in the making."""

    ref: TensorRef
    previous: Entry | None  # the previous checkpoint's entry (delta chunks unmatchable
    #                         when this one is full)
    base: Entry | None  # the last full checkpoint's entry: what deltas are against
    base_raw: Callable[[int], bytes] | None
    compress: bool | None  # None: its first changed chunk decides
    chunks: list[ChunkRef | None] = field(default_factory=list)
    added: int = 0  # bytes this entry added to the store
    resume_at: int = 0  # the first chunk the second pass encodes

    def __post_init__(self) -> None:
        self.chunks = [None] * max(1, -(-self.ref.nbytes // CHUNK_BYTES))

    def entry(self) -> Entry:
        assert all(c is not None for c in self.chunks)
        return Entry(name=self.ref.name, kind="tensor", size=self.ref.nbytes,
                     chunks=tuple(c for c in self.chunks if c is not None),
                     dtype=dtype_name(self.ref.dtype), shape=self.ref.shape)


class Persister:
    def __init__(self, store: CheckpointSink, buffers: HostBuffers, done: Done, *,
                 task_id: str, attempt: int, compression_level: int, diff_threshold: int,
                 delta_base: DeltaBase, nice: Priority, threads: int = 1,
                 cpu_share: float = 0.0, compress: Compress = "auto",
                 durable_within: float | None = None) -> None:
        self.store, self.buffers, self._done = store, buffers, done
        self.task_id, self.attempt = task_id, attempt
        self.level, self.diff_threshold, self.delta_base = (
            compression_level, diff_threshold, delta_base)
        self.nice, self.compress = nice, compress
        self.previous: Manifest | None = None  # the last committed checkpoint
        self.last_full: Manifest | None = None  # the last committed full checkpoint
        #: Prefix of this process's "packed" and "meta" entries ("rank3/" for a rank).
        self.prefix = ""
        #: Makes a checkpoint visible (replaced by a collective commit for ranks).
        self.commit: Callable[[Manifest], Manifest] = store.commit
        self.rates = Rates()
        self._compressing: dict[str, bool] = {}  # entry → compression paid when measured
        self._no_delta: set[str] = set()  # deltas did not pay since the last full one
        self.durable_within = durable_within
        self._local = threading.local()
        self._crew = Crew(threads, cpu_share, usable_cores(),
                          self._lower_priority)
        self._queue: queue.Queue[Snapshot | Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="m27-ckpt-persist",
                                        daemon=True)
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        self._queue.put(snapshot)

    def later(self, job: Callable[[], None]) -> None:
        """Run `job` on the persister's thread, between snapshots (e.g. preparing buffers)."""
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
        # Normal priority: this thread only hands chunks to the crew and commits. At idle
        # priority it would starve on a CPU-bound job and hold back the paced workers.
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
            if manifest is not None:
                self.previous = manifest  # (the checkpointer sets it too, under its lock)
                if manifest.full:
                    self.last_full = manifest
            self._done(snapshot, manifest, error)

    # ------------------------------------------------------------------ one snapshot

    def persist(self, snapshot: Snapshot) -> Manifest:
        if snapshot.error is not None:
            raise snapshot.error
        wait_readable(snapshot)
        previous = {e.name: e for e in self.previous.entries} if self.previous else {}
        fulls = {e.name: e for e in self.last_full.entries} if self.last_full else {}
        full = snapshot.kind.full
        if full:
            self._no_delta.clear()
        table, packed = [], bytearray()
        done: list[Entry] = []
        pending: list[Pending] = []
        for ref in snapshot.refs:
            ref.source = None  # the live tensor is no longer needed
            info: dict[str, object] = {"dtype": dtype_name(ref.dtype), "shape": list(ref.shape)}
            if ref.packed:
                packed.extend(bytes(-len(packed) % ALIGN))
                info["packed"] = [len(packed), ref.nbytes]
                packed.extend(_view(ref))
            else:
                info["entry"] = ref.name
                before = previous.get(ref.name)
                if ref.reuse and before is not None and before.size == ref.nbytes and \
                        (not full or all(c.base is None for c in before.chunks)):
                    done.append(before)  # unchanged since the last checkpoint
                else:
                    pending.append(self._pending(ref, before, fulls.get(ref.name), full,
                                                 sample=snapshot.kind.chain <= 1))
            table.append(info)
        snapshot.skeleton["tensors"] = table
        self._encode(snapshot, pending)
        entries = done + [p.entry() for p in pending]
        new_bytes = sum(p.added for p in pending)
        for p in pending:
            if p.base is not None and not delta_pays(sum(c.stored for c in p.entry().chunks),
                                                     sum(c.stored for c in p.base.chunks)):
                self._no_delta.add(p.ref.name)  # plain until the next full checkpoint
        for name, blob in ((f"{self.prefix}packed", packed),
                           (f"{self.prefix}meta", msgspec.json.encode(snapshot.skeleton))):
            entry, new = plan_entry(name, "bytes", memoryview(blob), previous.get(name),
                                    delta=False, compressor=self._compressor())
            entries.append(entry)
            new_bytes += self._upload(new)
        # Entries keep the snapshot's order of tensors (a reader does not depend on it).
        order = {ref.name: i for i, ref in enumerate(snapshot.refs)}
        entries.sort(key=lambda e: order.get(e.name, len(order)))
        return self.commit(self._manifest(snapshot, entries, new_bytes))

    def _pending(self, ref: TensorRef, before: Entry | None, full_entry: Entry | None,
                 full: bool, *, sample: bool) -> Pending:
        if self.compress == "auto":
            known = self._compressing.get(ref.name)
            compress = None if sample or known is None else known
        else:
            compress = self.compress == "always"
        base = None
        if not full and self.delta_base != "off" and compress is not False and \
                full_entry is not None and full_entry.size == ref.nbytes and \
                ref.nbytes >= self.diff_threshold and ref.name not in self._no_delta:
            base = full_entry
        return Pending(ref=ref, previous=without_deltas(before) if full else before,
                       base=base, base_raw=self._base_raw(ref, base) if base else None,
                       compress=compress)

    def _base_raw(self, ref: TensorRef, base: Entry) -> Callable[[int], bytes] | None:
        if self.delta_base == "memory" and ref.base is not None and \
                ref.base.numel() == base.size:
            held = ref.base.numpy().data
            return lambda i: bytes(held[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
        if self.delta_base == "store":
            chunks = base.chunks
            return lambda i: decode_chunk(chunks[i], self.store.read_chunk,
                                          zstandard.ZstdDecompressor())
        return None

    def _encode(self, snapshot: Snapshot, pending: list[Pending]) -> None:
        """Every pending entry's chunks, in two passes when some entry's first changed
        chunk must first show whether compressing it pays."""
        unpace_after = self._unpace_after(snapshot)
        deciding = [p for p in pending if p.compress is None]
        if deciding:
            self._crew.run(WorkList(deciding, self._sample), unpace_after)
            unpace_after = self._unpace_after(snapshot)
        items = [(p, i) for p in pending for i in range(p.resume_at, len(p.chunks))]
        work = WorkList(items, lambda item: self._chunk(item[0], item[1]))
        self._crew.run(work, unpace_after)
        snapshot.helped = work.unpaced.is_set() and work.paced_items > 0

    def _unpace_after(self, snapshot: Snapshot) -> float | None:
        """When paced workers stop pacing: at once for a requested checkpoint, else once
        it has taken `durable_within` seconds since after_step."""
        if snapshot.urgent:
            return 0.0
        if self.durable_within is None:
            return None
        return max(1e-3, self.durable_within - (time.perf_counter() - snapshot.started))

    def _sample(self, p: Pending) -> None:
        """Chunks up to the first changed one, which is encoded compressed and timed to
        decide the rest of the entry (unchanged entry: the last decision stands)."""
        for index in range(len(p.chunks)):
            p.resume_at = index + 1
            if self._chunk(p, index, measure=True):
                return
        p.compress = self._compressing.get(p.ref.name, False)

    def _chunk(self, p: Pending, index: int, *, measure: bool = False) -> bool:
        """Hash, encode and write chunk `index` of `p`; False when it was unchanged."""
        raw = _view(p.ref)[index * CHUNK_BYTES:(index + 1) * CHUNK_BYTES]
        raw_hash = sha256(raw)
        old = p.previous.chunks if p.previous is not None and \
            p.previous.size == p.ref.nbytes else ()
        before = old[index] if index < len(old) else None
        if before is not None and before.length == len(raw) and before.raw_sha256 == raw_hash:
            p.chunks[index] = before
            return False
        compress = True if measure else bool(p.compress)
        base = None
        if compress and p.base is not None and p.base_raw is not None:
            base = (p.base.chunks[index], p.base_raw(index))
        started = time.perf_counter()
        ref, payload = encode_chunk(raw, base, self._compressor(), compress=compress,
                                    raw_hash=raw_hash)
        if measure:
            self.rates.note("encode", len(raw), time.perf_counter() - started)
            saving = 1.0 - ref.stored / max(1, len(raw))
            p.compress = compression_pays(saving, self.rates.encode or float("inf"),
                                          self.rates.write)
            self._compressing[p.ref.name] = p.compress
            if not p.compress:  # stored raw after all: a restore reads it fastest
                ref, payload = encode_chunk(raw, None, self._compressor(), compress=False,
                                            raw_hash=raw_hash)
        p.added += self._upload({ref.id: payload})
        p.chunks[index] = ref
        return True

    def _upload(self, chunks: Mapping[str, Payload]) -> int:
        if not chunks:
            return 0
        missing = self.store.missing(list(chunks))
        if missing:
            started = time.perf_counter()
            self.store.put_chunks({cid: chunks[cid] for cid in chunks if cid in missing})
            self.rates.note("write", sum(len(chunks[cid]) for cid in missing),
                            time.perf_counter() - started)
        return sum(len(chunks[cid]) for cid in missing)

    def _manifest(self, snapshot: Snapshot, entries: list[Entry], new_bytes: int) -> Manifest:
        return Manifest(
            task_id=self.task_id, attempt=self.attempt, name=f"step-{snapshot.step}",
            created_at=snapshot.created_at, step=snapshot.step, epoch=snapshot.epoch,
            cursor=dict(snapshot.cursor), entries=tuple(entries), full=snapshot.kind.full,
            chain=snapshot.kind.chain, metadata={"format": FORMAT, "reason": snapshot.reason},
            size_bytes=sum(e.size for e in entries), new_bytes=new_bytes)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, e.g. a container's cpuset)."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _view(ref: TensorRef) -> memoryview:
    assert ref.data is not None
    return ref.data.numpy().data if ref.nbytes else memoryview(b"")


def max_chain(manifest: Manifest) -> int:
    """The longest delta chain a restore of `manifest` decodes."""
    return max((chain_depth(c) for e in manifest.entries for c in e.chunks), default=0)
