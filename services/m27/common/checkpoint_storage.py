"""Durable, verified storage of checkpoint chunks and manifests on a directory (local disk,
NAS or Lustre), and the store interface the training library writes through.

`ChunkDir` is the content-addressed chunk directory the checkpoint-store serves from and a
standalone training run (no services) writes into: `<root>/chunks/ab/abcdef…`, each written
to a temporary file, fsynced, renamed into place and its directory fsynced; every read is
verified against the chunk's id (its sha256). `LocalStore` adds manifests as JSON files
committed the same way — a manifest is written only after all its chunks are durable, so
a crash at any point leaves the previous checkpoint intact and visible.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final, Protocol

import msgspec

from m27.common.checkpoint_format import CorruptChunk, Manifest, Payload, is_chunk_id, sha256

TMP_PREFIX: Final = ".tmp-"
#: Where `m27.train` keeps a LocalStore inside M27_CHECKPOINT_DIR when no checkpoint-store
#: is known; the node-agent's upload of a step's own files leaves it alone.
TRAIN_STORE_SUBDIR: Final = "m27-train"
#: Never follow a symlink planted in the store, never block opening a FIFO.
READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class CheckpointSink(Protocol):
    """What the training library needs of a store (the checkpoint-store or a directory).
    Called from background threads. A chunk put is durable by the time a commit that
    names it returns (a directory fsyncs the chunks' folders once, in the commit); a
    commit is durable when it returns."""

    def missing(self, chunk_ids: Sequence[str]) -> set[str]: ...

    def put_chunks(self, chunks: Mapping[str, Payload]) -> None: ...

    def commit(self, manifest: Manifest) -> Manifest: ...

    def latest(self, task_id: str) -> Manifest | None: ...

    def list(self, task_id: str) -> list[Manifest]: ...

    def read_chunk(self, chunk_id: str) -> bytes:
        """A chunk's stored bytes, perhaps unverified: read them through `decode_chunk`."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: Payload, *, sync_dir: bool = True) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory (and the one
    above it when the directory is new, so its entry survives a crash too). `sync_dir`
    False: the caller fsyncs the directory later, before anything refers to the file."""
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        fsync_dir(path.parent.parent)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{secrets.token_hex(4)}")
    try:
        with tmp.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if sync_dir:
        fsync_dir(path.parent)


class ChunkDir:
    """Content-addressed chunks under `<root>/chunks`, verified on every read."""

    def __init__(self, root: Path) -> None:
        self.root = root / "chunks"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, chunk_id: str) -> Path:
        if not is_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id[:80]!r}")
        return self.root / chunk_id[:2] / chunk_id

    def has(self, chunk_id: str) -> bool:
        """A regular file under the id (a symlink or FIFO there is not a chunk)."""
        try:
            return stat.S_ISREG(os.lstat(self.path(chunk_id)).st_mode)
        except FileNotFoundError:
            return False

    def put(self, chunk_id: str, data: Payload, *, verify: bool = True,
            sync_dir: bool = True) -> bool:
        """Store a chunk (verified against its id unless the caller has just computed that
        id from these very bytes); False if it was there already. `sync_dir` False: the
        caller fsyncs the chunk's directory (`path(id).parent`) before committing."""
        if verify and sha256(data) != chunk_id:
            raise CorruptChunk(f"chunk {chunk_id[:12]} does not match its bytes")
        if self.has(chunk_id):
            return False
        write_durably(self.path(chunk_id), data, sync_dir=sync_dir)
        return True

    def get(self, chunk_id: str, *, verify: bool = True) -> bytes:
        """The chunk's bytes; CorruptChunk if they no longer match their id (`verify`
        False: the caller verifies, as `decode_chunk` does, so the bytes are hashed once)."""
        fd = os.open(self.path(chunk_id), READ_FLAGS)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CorruptChunk(f"chunk {chunk_id[:12]} is not a regular file")
            data = file.read()
        if verify and sha256(data) != chunk_id:
            raise CorruptChunk(f"chunk {chunk_id[:12]} is corrupt on disk")
        return data

    def read_into(self, chunk_id: str, target: memoryview) -> None:
        """Read a chunk of exactly `len(target)` stored bytes straight into `target`, not
        verified (the caller hashes `target`); CorruptChunk if its size differs."""
        fd = os.open(self.path(chunk_id), READ_FLAGS)
        with os.fdopen(fd, "rb", buffering=0) as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size != len(target):
                raise CorruptChunk(f"chunk {chunk_id[:12]} is not {len(target)} bytes on disk")
            done = 0
            while done < len(target):
                read = file.readinto(target[done:])
                if not read:
                    raise CorruptChunk(f"chunk {chunk_id[:12]} ended early")
                done += read

    def ids(self) -> Iterable[str]:
        for folder in self.root.iterdir():
            if folder.is_dir():
                for file in folder.iterdir():
                    if is_chunk_id(file.name):
                        yield file.name

    def delete(self, chunk_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(chunk_id).unlink()

    def age_s(self, chunk_id: str, now: float) -> float:
        try:
            return now - self.path(chunk_id).stat().st_mtime
        except FileNotFoundError:
            return 0.0


def new_checkpoint_id(now: float) -> str:
    """`c-<unix ms, 13 digits>-<6 hex>`: sorts by commit time."""
    return f"c-{int(now * 1000):013d}-{secrets.token_hex(3)}"


class LocalStore:
    """A checkpoint store in a directory: what a run uses without any m27 service (on a
    laptop), with the same chunk layout as the checkpoint-store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.chunks = ChunkDir(root)
        self.manifests = root / "manifests"
        self.manifests.mkdir(parents=True, exist_ok=True)
        self._unsynced: set[Path] = set()  # chunk directories to fsync before a commit
        self._lock = threading.Lock()

    def missing(self, chunk_ids: Sequence[str]) -> set[str]:
        return {c for c in chunk_ids if not self.chunks.has(c)}

    def put_chunks(self, chunks: Mapping[str, Payload]) -> None:
        """Stored as given: the writer (this process) computed each id from its bytes, and
        every read verifies them. Each file is fsynced here, its folder in `commit`."""
        for chunk_id, data in chunks.items():
            self.chunks.put(chunk_id, data, verify=False, sync_dir=False)
            with self._lock:  # (also when it was there: perhaps not yet synced either)
                self._unsynced.add(self.chunks.path(chunk_id).parent)

    def commit(self, manifest: Manifest) -> Manifest:
        """Make the checkpoint visible: its chunks must all be stored already."""
        from m27.common.checkpoint_format import chunk_ids

        absent = self.missing(sorted(chunk_ids(manifest)))
        if absent:
            raise ValueError(f"{len(absent)} chunk(s) of the checkpoint are not stored")
        with self._lock:
            unsynced, self._unsynced = self._unsynced, set()
        for folder in sorted(unsynced):  # the chunks' names are durable before the manifest
            fsync_dir(folder)
        committed = msgspec.structs.replace(
            manifest, checkpoint_id=manifest.checkpoint_id or new_checkpoint_id(time.time()))
        write_durably(self._path(committed.task_id, committed.checkpoint_id),
                      msgspec.json.encode(committed))
        return committed

    def _path(self, task_id: str, checkpoint_id: str) -> Path:
        safe = task_id.replace("/", ".")
        if not safe or safe.startswith(".") or "/" in safe or ".." in safe.split("."):
            raise ValueError(f"not a task id: {task_id[:80]!r}")
        return self.manifests / safe / f"{checkpoint_id}.json"

    def list(self, task_id: str) -> list[Manifest]:
        folder = self._path(task_id, "x").parent
        if not folder.is_dir():
            return []
        found = []
        for file in sorted(folder.glob("c-*.json")):
            with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
                found.append(msgspec.json.decode(file.read_bytes(), type=Manifest))
        return found

    def latest(self, task_id: str) -> Manifest | None:
        found = self.list(task_id)
        return found[-1] if found else None

    def delete(self, task_id: str, checkpoint_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(task_id, checkpoint_id).unlink()

    def read_chunk(self, chunk_id: str) -> bytes:
        """Not hashed here: `decode_chunk`, the only reader, verifies every chunk."""
        return self.chunks.get(chunk_id, verify=False)

    def read_chunk_into(self, chunk_id: str, target: memoryview) -> None:
        """A raw chunk straight into its place in a tensor (the caller verifies it)."""
        self.chunks.read_into(chunk_id, target)
