"""Ready-pool staging: read a waiting task's inputs into this node's page cache.

A task in the ready pool will most likely start on this node; its inputs (files or
directories, usually on shared storage) are read ahead now, so the task does not start by
waiting on cold storage. The kernel does the reading (`posix_fadvise(WILLNEED)` starts
readahead of the whole file and returns), so staging costs the agent almost nothing; the
data stays where it is, nothing is copied.

What is read is bounded: at most `max_bytes` in all and `max_files` files; symbolic links
are not followed (a link could point anywhere, and a loop would never end); FIFOs, sockets
and devices are skipped unopened (opening a FIFO blocks).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable, Iterator
from typing import Final

import msgspec

MAX_BYTES: Final = 8 << 30
MAX_FILES: Final = 100_000


class Staged(msgspec.Struct, frozen=True, kw_only=True):
    files: int
    bytes: int
    seconds: float
    missing: tuple[str, ...] = ()
    skipped: int = 0  # over the limits, or not a regular file


def _walk(path: str) -> Iterator[tuple[str, os.stat_result]]:
    """Regular files and everything else under `path`, without following links."""
    try:
        info = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(info.st_mode):
        yield path, info
        return
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        yield from _walk(entry.path)


def _read_ahead(path: str, size: int) -> bool:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        else:  # pragma: no cover - not Linux: read it through once
            while os.read(fd, 1 << 20):
                pass
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def stage_inputs(paths: Iterable[str], *, max_bytes: int = MAX_BYTES,
                 max_files: int = MAX_FILES) -> Staged:
    """Read ahead every regular file under `paths` until a limit is reached."""
    start = time.monotonic()
    files = total = skipped = 0
    missing: list[str] = []
    for path in paths:
        if not os.path.lexists(path):
            missing.append(path)
            continue
        for name, info in _walk(path):
            regular = stat.S_ISREG(info.st_mode)
            if (not regular or files >= max_files or total + info.st_size > max_bytes
                    or not _read_ahead(name, info.st_size)):
                skipped += 1
                continue
            files += 1
            total += info.st_size
    return Staged(files=files, bytes=total, seconds=time.monotonic() - start,
                  missing=tuple(missing), skipped=skipped)
