"""Durable file writes: a reader sees the old report or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Final

#: Reports are for people to open (and share): readable like any file written with umask 022.
REPORT_MODE: Final = 0o644


def write_atomic(path: Path, text: str, *, mode: int = REPORT_MODE) -> None:
    """Write `text` (UTF-8) to `path` via a temp file in the same directory, fsync, rename.

    The directory is fsynced too, so once this returns the new file survives a power cut:
    the shell acks the event only after that.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        tmp.chmod(mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some file systems refuse to fsync a directory
            os.fsync(fd)
    finally:
        os.close(fd)
