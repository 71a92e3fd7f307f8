"""Size-based rotation of a service's own log file (`m27 up` sends each service's stdout
and stderr to `$M27_HOME/logs/<service>.log`, named in `M27_LOG_FILE`).

Every line the service logs is written straight to the file descriptor; once the file is
past `M27_LOG_MAX_BYTES` (default 64 MiB) it is renamed `<service>.log.1` (older ones
shift to `.2` …, `M27_LOG_KEEP` of them kept, default 3) and a fresh file takes over stdout
and stderr (`dup2`), so a traceback printed by the interpreter lands in the new file too.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from m27.common.errors import ConfigError

DEFAULT_MAX_BYTES: Final = 64 << 20
DEFAULT_KEEP: Final = 3
MIN_MAX_BYTES: Final = 1024


class RotatingLog:
    """A text stream for structlog and logging handlers that rotates `path` by size; it
    writes to `fds[-1]` and points every one of `fds` at the new file after a rotation."""

    def __init__(self, path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 keep: int = DEFAULT_KEEP, fds: tuple[int, ...] = (1, 2)) -> None:
        self.path, self.max_bytes, self.keep, self.fds = path, max_bytes, keep, fds
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        data = text.encode("utf-8", "replace")
        with self.lock:
            os.write(self.fds[-1], data)
            # only at the end of a line (print() writes the newline on its own)
            if data.endswith(b"\n") and os.fstat(self.fds[-1]).st_size >= self.max_bytes:
                self._rotate()
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""

    def isatty(self) -> bool:
        return False

    def _rotate(self) -> None:
        for index in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        if self.keep > 0:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
        try:
            for target in self.fds:
                os.dup2(fd, target)
        finally:
            os.close(fd)


def from_environment(environ: Mapping[str, str]) -> RotatingLog | None:
    """The rotating log `m27 up` asked for (`M27_LOG_FILE`), or None: log to stderr as is.
    A bad `M27_LOG_MAX_BYTES` / `M27_LOG_KEEP` is a clear error."""
    name = environ.get("M27_LOG_FILE", "")
    if not name:
        return None
    max_bytes = _int(environ, "M27_LOG_MAX_BYTES", DEFAULT_MAX_BYTES, MIN_MAX_BYTES)
    keep = _int(environ, "M27_LOG_KEEP", DEFAULT_KEEP, 0)
    return RotatingLog(Path(name), max_bytes=max_bytes, keep=keep)


def _int(environ: Mapping[str, str], key: str, default: int, least: int) -> int:
    text = environ.get(key, "")
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{key}={text[:40]!r}: expected a whole number") from None
    if value < least:
        raise ConfigError(f"{key}={value}: must be at least {least}")
    return value
