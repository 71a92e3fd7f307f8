"""Step log files as the node-agent writes them, read safely: `m27 logs`, `TailLog`.

A step's output lives at `<run dir>/logs/<step>.<attempt>.out|err` (see
`m27.node_agent._tasks.task_paths`). The step itself can write into its run's directory, so
it could swap a log (or the logs dir) for a symlink or a FIFO: every path component is
opened with O_NOFOLLOW, the file non-blocking, and only a regular file is read.
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, Literal

import msgspec

from m27.common.errors import M27Error, NotFoundError
from m27.common.ids import is_valid_name
from m27.common.paths import run_dir

Stream = Literal["stdout", "stderr"]
STREAMS: Final[tuple[Stream, ...]] = ("stdout", "stderr")
SUFFIXES: Final[dict[Stream, str]] = {"stdout": "out", "stderr": "err"}
#: The most one chunk carries.
CHUNK_BYTES: Final = 64 * 1024
#: Chunks read from one file before the other gets its turn (a chatty stdout must not
#: starve stderr).
ROUND_CHUNKS: Final = 16
POLL_S: Final = 0.2

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

StillRunning = Callable[[], Awaitable[bool]]


class LogError(M27Error):
    """A log file that cannot be read as one (a symlink, a FIFO, no permission)."""


class LogNotFound(LogError, NotFoundError):
    """No such log file."""


class LogChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes of one log file, and where in that file they start."""

    stream: Stream
    data: bytes
    offset: int


class LogQuery(msgspec.Struct, frozen=True, kw_only=True):
    """Which logs of which attempt, and how: the validated form of a request."""

    run_id: str
    step: str
    attempt: int
    streams: tuple[Stream, ...] = STREAMS
    follow: bool = False
    tail_bytes: int = 0


def parse_streams(value: str) -> tuple[Stream, ...]:
    """`stdout`, `stderr`, or both (`both` or empty); ValueError for anything else."""
    if value in ("", "both"):
        return STREAMS
    for stream in STREAMS:
        if value == stream:
            return (stream,)
    raise ValueError(f"stream must be stdout, stderr or both, not {value[:40]!r}")


def log_name(step: str, attempt: int, stream: Stream) -> str:
    return f"{step}.{attempt}.{SUFFIXES[stream]}"


def log_path(home: Path, run_id: str, step: str, attempt: int, stream: Stream) -> Path:
    """Where the agent writes this log (for messages; reading goes through `open_log`)."""
    return run_dir(home, run_id) / "logs" / log_name(step, attempt, stream)


def start_offset(size: int, tail_bytes: int) -> int:
    """Where reading starts: `tail_bytes` before the end, or the start (0: everything)."""
    return max(0, size - tail_bytes) if tail_bytes > 0 else 0


class LogFile:
    """One open log file and how far it has been read. Its methods block (run them in a
    thread): a log on a network mount can be slow."""

    def __init__(self, stream: Stream, fd: int, path: Path) -> None:
        self.stream: Stream = stream
        self.path = path
        self.position = 0
        self.end: int | None = None  # stop here (not following), else read as it grows
        self._fd = fd

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read(self, limit: int = CHUNK_BYTES) -> LogChunk | None:
        """The next chunk, or None when there is nothing more yet."""
        size = self.size()
        if size < self.position:  # truncated: read it again from its start
            self.position = 0
        want = min(limit, CHUNK_BYTES)
        if self.end is not None:
            want = min(want, self.end - self.position)
        if want <= 0:
            return None
        data = os.pread(self._fd, want, self.position)
        if not data:
            return None
        chunk = LogChunk(stream=self.stream, data=data, offset=self.position)
        self.position += len(data)
        return chunk

    def close(self) -> None:
        os.close(self._fd)


def open_log(home: Path, run_id: str, step: str, attempt: int, stream: Stream) -> LogFile:
    """Open one log without following a symlink anywhere below `<home>/runs`.

    LogNotFound when it does not exist, LogError when it is not a regular file.
    """
    if not (is_valid_name(run_id) and is_valid_name(step)) or attempt < 1:
        raise ValueError(f"not a log of a task attempt: {run_id!r} {step!r} {attempt}")
    path = log_path(home, run_id, step, attempt, stream)
    fd = _open_below(home / "runs", (run_id, "logs"), log_name(step, attempt, stream), path)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise LogError(f"{path} is not a regular file; m27 reads only regular log files")
    return LogFile(stream, fd, path)


def _open_below(root: Path, dirs: Sequence[str], name: str, path: Path) -> int:
    """Walk from `root` one component at a time, refusing a symlink at every step."""
    opened: list[int] = []
    try:
        opened.append(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        for part in dirs:
            opened.append(_open_at(part, _DIR_FLAGS, opened[-1], path))
        return _open_at(name, _FILE_FLAGS, opened[-1], path)
    except FileNotFoundError as exc:
        raise LogNotFound(f"no log file {path}") from exc
    except OSError as exc:
        raise LogError(f"cannot read {path}: {exc.strerror}") from exc
    finally:
        for fd in opened:
            os.close(fd)


def _open_at(name: str, flags: int, dir_fd: int, path: Path) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        # O_NOFOLLOW refuses a link with ELOOP, or with ENOTDIR when O_DIRECTORY is set.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, dir_fd):
            raise LogError(f"{path} (or a directory above it) is a symbolic link; m27 does "
                           "not follow links out of the logs directory") from exc
        if exc.errno == errno.ENOTDIR:
            raise LogNotFound(f"no log file {path}") from exc
        raise


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def open_logs(home: Path, query: LogQuery,
              resume: Mapping[str, int] | None = None) -> list[LogFile]:
    """The query's log files, positioned: `resume` offsets first, else its tail_bytes.

    A stream asked for by name must exist; of both, at least one. Without follow, each file
    is read up to its size now.
    """
    files: list[LogFile] = []
    missing: list[LogNotFound] = []
    try:
        for stream in query.streams:
            try:
                files.append(open_log(home, query.run_id, query.step, query.attempt, stream))
            except LogNotFound as exc:
                missing.append(exc)
        if missing and (len(query.streams) == 1 or not files):
            raise missing[0]
        for file in files:
            _position(file, query, resume or {})
    except BaseException:
        close_all(files)
        raise
    return files


def _position(file: LogFile, query: LogQuery, resume: Mapping[str, int]) -> None:
    size = file.size()
    file.position = resume.get(file.stream, start_offset(size, query.tail_bytes))
    if not query.follow:
        file.end = size


def close_all(files: Sequence[LogFile]) -> None:
    for file in files:
        try:
            file.close()
        except OSError:
            continue


async def _never() -> bool:
    return False


async def tail(files: Sequence[LogFile], *, follow: bool = False,
               still_running: StillRunning = _never,
               poll_s: float = POLL_S) -> AsyncIterator[LogChunk]:
    """Chunks of every file, in turns; with `follow`, new bytes as they come until
    `still_running` says no and everything written until then has been read.

    Whether it still runs is asked *before* a round of reading, so the last bytes a task
    wrote before it ended are always read.
    """
    while True:
        running = follow and await still_running()
        more = False
        for file in files:
            for _ in range(ROUND_CHUNKS):
                chunk = await asyncio.to_thread(file.read)
                if chunk is None:
                    break
                yield chunk
            else:
                more = True
        if more:
            continue
        if not running:
            return
        await asyncio.sleep(poll_s)
