"""The chunk directory as the store serves it: `checkpoint_storage.ChunkDir`, hardened.

Everything here blocks; the async store calls it in worker threads. On top of `ChunkDir`
(content-addressed files, written to a temp file, fsynced, renamed, directory fsynced):
- the 256 prefix directories are made (durably) at start, so no write ever depends on a
  directory entry that was not fsynced, and a symlink in their place stops the store;
- reads never follow a symlink, never block on a FIFO, and are verified against the id; a
  chunk that fails verification is moved to `<root>/quarantine/` so it reads as missing
  from then on (the next restore falls back, and a re-upload of the same bytes repairs it);
- a chunk that a client is told exists, or that a commit references, gets its mtime
  refreshed, so garbage collection's grace period protects it until the commit lands.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final

from m27.checkpoint_store._retention import ChunkFile
from m27.common.checkpoint_api import (
    CheckpointCorrupt,
    ChunkMissing,
    StorageError,
    StorageFull,
)
from m27.common.checkpoint_format import CorruptChunk, is_chunk_id, sha256
from m27.common.checkpoint_storage import READ_FLAGS, TMP_PREFIX, ChunkDir, fsync_dir
from m27.common.logging import get_logger

log = get_logger()

QUARANTINE_DIR: Final = "quarantine"
PREFIXES: Final = tuple(f"{i:02x}" for i in range(256))


@contextlib.contextmanager
def os_errors(action: str) -> Iterator[None]:
    """OSError as the store's own errors, with the reason and without any path."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFull(f"cannot {action}: the checkpoint disk is full ({reason})") from exc
        raise StorageError(f"cannot {action}: {reason}") from exc


class ChunkStore:
    """Verified chunks under `<root>/chunks/<2 hex>/<sha256>`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with os_errors("open the checkpoint directory"):
            self.dir = ChunkDir(root)
        self.quarantine_dir = root / QUARANTINE_DIR

    def prepare(self, *, temp_older_than_s: float = 0.0) -> int:
        """Make the prefix directories durably; remove temp files a crash left behind
        (older than `temp_older_than_s`); return how many were removed."""
        with os_errors("prepare the checkpoint directory"):
            made = False
            for prefix in PREFIXES:
                folder = self.dir.root / prefix
                try:
                    info = folder.lstat()
                except FileNotFoundError:
                    folder.mkdir(mode=0o700)
                    made = True
                    continue
                if not stat.S_ISDIR(info.st_mode):
                    raise StorageError(f"{folder} is not a directory (a symlink?): refusing "
                                       "to store checkpoints through it")
            if made:
                fsync_dir(self.dir.root)
                fsync_dir(self.root)
            self.quarantine_dir.mkdir(mode=0o700, exist_ok=True)
            return self.remove_temp_files(time.time() - temp_older_than_s)

    def remove_temp_files(self, cutoff: float) -> int:
        """Temp files of interrupted writes last modified before `cutoff`."""
        removed = 0
        for prefix in PREFIXES:
            with contextlib.suppress(FileNotFoundError), os.scandir(self.dir.root / prefix) as it:
                for item in it:
                    if item.name.startswith(TMP_PREFIX) and \
                            item.stat(follow_symlinks=False).st_mtime < cutoff:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(item.path)
                            removed += 1
        return removed

    def missing(self, chunk_ids: Sequence[str]) -> list[str]:
        """The ids not stored; the ones stored are touched (see the module docstring)."""
        absent = []
        for chunk_id in chunk_ids:
            if not self._touch(chunk_id):
                absent.append(chunk_id)
        return absent

    def _touch(self, chunk_id: str) -> bool:
        path = self.dir.path(chunk_id)
        try:
            if not stat.S_ISREG(path.lstat().st_mode):
                return False
            os.utime(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot check chunk {chunk_id[:12]}: {exc.strerror}") from exc
        return True

    def put(self, chunk_id: str, data: bytes) -> bool:
        """Store one chunk durably, verified against its id; False if it was there."""
        with os_errors(f"store chunk {chunk_id[:12]}"):
            try:
                written = self.dir.put(chunk_id, data)
            except CorruptChunk:
                raise CheckpointCorrupt(
                    f"chunk {chunk_id} does not match its bytes (sha256 {sha256(data)}); "
                    "not stored") from None
            if not written:
                self._touch(chunk_id)
        return written

    def problems(self, sizes: Mapping[str, int], *, touch: bool = False) -> dict[str, str]:
        """Chunk id → what is wrong with it (missing, not a file, wrong size): the cheap
        check of a manifest's chunks, without reading them."""
        found: dict[str, str] = {}
        for chunk_id, size in sizes.items():
            path = self.dir.path(chunk_id)
            try:
                info = path.lstat()
            except FileNotFoundError:
                found[chunk_id] = "missing"
                continue
            except OSError as exc:
                raise StorageError(f"cannot check chunk {chunk_id[:12]}: {exc.strerror}") from exc
            if not stat.S_ISREG(info.st_mode):
                found[chunk_id] = "not a plain file"
            elif info.st_size != size:
                found[chunk_id] = f"{info.st_size} bytes on disk, {size} expected"
            elif touch:
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path, follow_symlinks=False)
        return found

    def read(self, chunk_id: str) -> bytes:
        """The chunk's bytes, verified; ChunkMissing, or CheckpointCorrupt (after moving
        the damaged file to quarantine)."""
        path = self.dir.path(chunk_id)
        try:
            fd = os.open(path, READ_FLAGS)
        except FileNotFoundError:
            raise ChunkMissing(f"chunk {chunk_id} is not in the store") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointCorrupt(f"chunk {chunk_id} is not a plain file (a symlink?); "
                                        "refusing to follow it") from None
            raise StorageError(f"cannot read chunk {chunk_id[:12]}: {exc.strerror}") from exc
        with os.fdopen(fd, "rb") as file, os_errors(f"read chunk {chunk_id[:12]}"):
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointCorrupt(f"chunk {chunk_id} is not a plain file")
            data = file.read()
        actual = sha256(data)
        if actual != chunk_id:
            self.quarantine(chunk_id, path)
            raise CheckpointCorrupt(f"chunk {chunk_id} is corrupt on disk (its bytes hash to "
                                    f"{actual[:12]}…); moved to quarantine")
        return data

    def quarantine(self, chunk_id: str, path: Path) -> None:
        target = self.quarantine_dir / f"{chunk_id}.{int(time.time() * 1000)}"
        with contextlib.suppress(FileNotFoundError), os_errors("quarantine a damaged chunk"):
            os.rename(path, target)
            fsync_dir(path.parent)
            fsync_dir(self.quarantine_dir)
            log.error("checkpoint.chunk_quarantined", chunk_id=chunk_id, moved_to=str(target))

    def files(self) -> Iterator[ChunkFile]:
        """Every chunk file with its mtime (garbage collection's view)."""
        for prefix in PREFIXES:
            with contextlib.suppress(FileNotFoundError), os.scandir(self.dir.root / prefix) as it:
                for item in it:
                    if not is_chunk_id(item.name):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        info = item.stat(follow_symlinks=False)
                        yield ChunkFile(item.name, info.st_mtime, info.st_size)

    def delete_if_older(self, chunk_id: str, cutoff: float) -> bool:
        """Remove a chunk unless it was touched at or after `cutoff` since it was listed."""
        path = self.dir.path(chunk_id)
        with os_errors(f"delete chunk {chunk_id[:12]}"):
            try:
                if path.lstat().st_mtime >= cutoff:
                    return False
                path.unlink()
            except FileNotFoundError:
                return False
        return True

    def sync_prefixes(self, prefixes: set[str]) -> None:
        """Make deletions durable: fsync the directories they happened in."""
        with os_errors("sync the checkpoint directory"):
            for prefix in sorted(prefixes):
                fsync_dir(self.dir.root / prefix)
