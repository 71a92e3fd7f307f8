"""Where checkpoint bytes live: a small blocking interface and its plain-file implementation.

The interface (`BlobStore`, `BlobWriter`, `BlobReader`) is what a later content-addressed,
compressed layout replaces. Everything here blocks; the async store calls it in a thread.

`FileBlobStore` keeps `<root>/<run_id>/<step>/<checkpoint_id>.blob`. A write goes to a
temp file in `<root>/.tmp/`, is fsynced, renamed into place and its directory fsynced, so
a crash leaves either the whole blob or nothing but a temp file (removed by `recover`).
Paths are walked one component at a time with O_NOFOLLOW: a symlink planted below the
root is refused, never followed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Final, Protocol

import msgspec

from m27.checkpoint_store._errors import (
    BlobMissing,
    CheckpointCorrupt,
    StorageError,
    StorageFull,
)
from m27.checkpoint_store._ids import CheckpointRef
from m27.checkpoint_store._model import PLAIN_LAYOUT

TEMP_DIR: Final = ".tmp"
TEMP_SUFFIX: Final = ".part"
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted in place of a blob must fail the type check, not hang open().
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_TEMP_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class BlobDigest(msgspec.Struct, frozen=True):
    """What a committed blob holds: its length and the sha256 of its bytes (hex)."""

    size_bytes: int
    sha256: str


class BlobWriter(Protocol):
    def write(self, data: bytes | bytearray) -> None:
        """Append bytes (not yet durable)."""

    def commit(self, ref: CheckpointRef) -> BlobDigest:
        """Make the bytes durable under `ref`; after this the blob survives a crash."""

    def abort(self) -> None:
        """Throw away an uncommitted write; harmless after commit or a second time."""


class BlobReader(Protocol):
    @property
    def size(self) -> int:
        """The stored length in bytes."""

    def read(self, n: int) -> bytes:
        """Up to `n` bytes; fewer only at the end, b"" after it."""

    def close(self) -> None: ...


class BlobStore(Protocol):
    #: The `CheckpointRecord.layout` this store reads and writes.
    layout: str

    def recover(self) -> int:
        """Prepare the store at start; return how many leftovers of a crash were removed."""

    def create(self) -> BlobWriter: ...

    def open(self, ref: CheckpointRef) -> BlobReader:
        """The blob's bytes; BlobMissing when there is none, CheckpointCorrupt when it is
        not a plain file."""

    def delete(self, ref: CheckpointRef) -> bool:
        """Remove the blob; False when there was none."""


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


class FileBlobStore:
    """Plain blobs as files below `root`, written atomically and durably."""

    layout = PLAIN_LAYOUT

    def __init__(self, root: Path) -> None:
        self.root = root

    def recover(self) -> int:
        """Create the root if needed and delete temp files a crashed Put left behind."""
        with os_errors("prepare the checkpoint directory"):
            self.root.mkdir(parents=True, exist_ok=True)
            with self._dir([TEMP_DIR], create=True) as temp:
                leftovers = [n for n in os.listdir(temp) if n.endswith(TEMP_SUFFIX)]
                for name in leftovers:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=temp)
                if leftovers:
                    os.fsync(temp)
        return len(leftovers)

    def create(self) -> FileBlobWriter:
        name = f"{secrets.token_hex(16)}{TEMP_SUFFIX}"
        with os_errors("start a checkpoint file"), self._dir([TEMP_DIR], create=True) as temp:
            fd = os.open(name, _TEMP_FLAGS, 0o600, dir_fd=temp)
        return FileBlobWriter(self, name, os.fdopen(fd, "wb"))

    def open(self, ref: CheckpointRef) -> FileBlobReader:
        *dirs, file_name = ref.blob_parts
        try:
            with self._dir(dirs, create=False) as parent:
                fd = os.open(file_name, _READ_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            raise BlobMissing(f"no blob for {ref.task_id} {ref.checkpoint_id}") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CheckpointCorrupt(
                    f"the blob of {ref.task_id} {ref.checkpoint_id} is not a plain file "
                    "(a symlink?); refusing to follow it") from None
            raise StorageError(f"cannot open a checkpoint: {exc.strerror}") from exc
        return FileBlobReader.from_fd(fd, ref)

    def delete(self, ref: CheckpointRef) -> bool:
        *dirs, file_name = ref.blob_parts
        with os_errors("delete a checkpoint file"):
            try:
                with self._dir(dirs, create=False) as parent:
                    os.unlink(file_name, dir_fd=parent)
                    os.fsync(parent)
            except FileNotFoundError:
                return False
        return True

    def install(self, temp_name: str, ref: CheckpointRef) -> None:
        """Rename a finished temp file to its final name and make the rename durable."""
        *dirs, file_name = ref.blob_parts
        with (os_errors("store a checkpoint file"),
              self._dir([TEMP_DIR], create=True) as temp,
              self._dir(dirs, create=True) as parent):
            os.rename(temp_name, file_name, src_dir_fd=temp, dst_dir_fd=parent)
            os.fsync(parent)

    def remove_temp(self, temp_name: str) -> None:
        with (contextlib.suppress(OSError), self._dir([TEMP_DIR], create=False) as temp):
            os.unlink(temp_name, dir_fd=temp)

    @contextlib.contextmanager
    def _dir(self, names: Sequence[str], *, create: bool) -> Iterator[int]:
        """A directory fd below the root, walked without following any symlink."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in names:
                child = _open_subdir(fd, name, create=create)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)


def _open_subdir(parent: int, name: str, *, create: bool) -> int:
    """Open (or create, durably) the directory `name` in `parent`; never a symlink."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        pass  # a concurrent Put of the same task made it first
    else:
        os.fsync(parent)  # the new directory's entry must survive a crash too
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


class FileBlobWriter:
    """One blob being written to a temp file, hashed as it goes."""

    def __init__(self, store: FileBlobStore, temp_name: str, file: BinaryIO) -> None:
        self._store = store
        self._temp_name = temp_name
        self._file = file
        self._hash = hashlib.sha256()
        self._size = 0
        self._done = False

    def write(self, data: bytes | bytearray) -> None:
        with os_errors("write a checkpoint"):
            self._file.write(data)
        self._hash.update(data)
        self._size += len(data)

    def commit(self, ref: CheckpointRef) -> BlobDigest:
        with os_errors("write a checkpoint"):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        self._store.install(self._temp_name, ref)
        self._done = True
        return BlobDigest(self._size, self._hash.hexdigest())

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):
            self._file.close()
        self._store.remove_temp(self._temp_name)


class FileBlobReader:
    """An open blob file; its size is taken from the open file, not from a path."""

    def __init__(self, file: BinaryIO, size: int) -> None:
        self._file = file
        self._size = size

    @classmethod
    def from_fd(cls, fd: int, ref: CheckpointRef) -> FileBlobReader:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise CheckpointCorrupt(
                f"the blob of {ref.task_id} {ref.checkpoint_id} is not a plain file")
        return cls(os.fdopen(fd, "rb"), info.st_size)

    @property
    def size(self) -> int:
        return self._size

    def read(self, n: int) -> bytes:
        with os_errors("read a checkpoint"):
            return self._file.read(n)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
