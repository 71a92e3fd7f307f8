"""Processes and process groups: the only place the agent touches the OS for a task.

A step runs as `/bin/sh -c <command>` in its own session, so its process group id is its
pid and everything it starts (unless it leaves the session itself) can be signalled at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from m27.node_agent import _mask
from m27.node_agent._tasks import decode_tail, output_path

SHELL = "/bin/sh"


async def spawn(command: str, *, cwd: Path, env: Mapping[str, str], stdout: Path,
                stderr: Path, mask: Sequence[str] = ()) -> asyncio.subprocess.Process:
    """Start the command in a new session; stdin is /dev/null, output goes to the log files.

    With values to `mask` (the step's secrets), output goes through pipes to a masker
    process (`_mask`) that writes it to the log files with each value replaced by `***`,
    so no log file m27 writes, serves or reports holds them. The masker is in a session
    of its own: signals to the step's group do not reach it, and it ends once every
    process holding the pipes has.

    The command string goes to sh untouched: the agent adds no quoting or expansion.
    Raises OSError / ValueError when it cannot be started.
    """
    out, err = _open_logs(cwd, stdout, stderr)
    with out, err:
        if not _mask.patterns(mask):
            return await asyncio.create_subprocess_exec(
                SHELL, "-c", command,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err,
                cwd=cwd, env=dict(env), start_new_session=True,
            )
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            masker = _start_masker(mask, [(out_read, out.fileno()), (err_read, err.fileno())])
            process = await asyncio.create_subprocess_exec(
                SHELL, "-c", command,
                stdin=asyncio.subprocess.DEVNULL, stdout=out_write, stderr=err_write,
                cwd=cwd, env=dict(env), start_new_session=True,
            )
        finally:
            for fd in (out_read, out_write, err_read, err_write):
                os.close(fd)
        _maskers[process.pid] = masker
        return process


#: The masker of each masked step still running, by the step's pid.
_maskers: dict[int, subprocess.Popen[bytes]] = {}
#: How long a step's end waits for its masker to write the last output.
MASKER_WAIT_S = 5.0


def _start_masker(values: Sequence[str],
                  pipes: Sequence[tuple[int, int]]) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-S", _mask.SCRIPT]
    for source, target in pipes:
        args += ["--pipe", f"{source}:{target}"]
    return subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        pass_fds=[fd for pair in pipes for fd in pair], start_new_session=True,
        env={_mask.VALUES_ENV: json.dumps(list(values))})


async def output_written(pid: int, timeout: float = MASKER_WAIT_S) -> bool:
    """Once the step whose pid this was has ended (its group killed): wait until its
    masker has written all of its output (at once for an unmasked step). False when
    something that left the group still holds the pipes past `timeout`."""
    masker = _maskers.pop(pid, None)
    if masker is None:
        return True
    try:
        await asyncio.to_thread(masker.wait, timeout)
    except subprocess.TimeoutExpired:
        return False  # it ends with the last writer; Popen reaps it then
    return True


def _open_logs(cwd: Path, stdout: Path, stderr: Path) -> tuple[BinaryIO, BinaryIO]:
    if not cwd.is_dir():
        raise NotADirectoryError(f"workdir {cwd} does not exist or is not a directory")
    stdout.parent.mkdir(parents=True, exist_ok=True)
    stderr.parent.mkdir(parents=True, exist_ok=True)
    out = stdout.open("wb")
    try:
        return out, stderr.open("wb")
    except OSError:
        out.close()
        raise


def signal_by_name(name: str) -> signal.Signals:
    """`SIGUSR1` → the signal; SIGUSR1 for a name this system does not know."""
    return getattr(signal.Signals, name, signal.SIGUSR1)


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a whole process group; False when the group is already gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Only possible if the pgid was reused by someone else's group: never touch that.
        return False
    return True


def group_running(pgid: int) -> bool:
    """Whether a process of the group is still running (zombies waiting to be reaped by
    whoever adopted them do not count)."""
    if not signal_group(pgid, 0):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


async def wait_group(pgid: int, deadline: float, poll_s: float = 0.1) -> bool:
    """Wait until no process of the group runs or the monotonic `deadline` passes; True
    when the group ended by itself."""
    loop = asyncio.get_running_loop()
    while await asyncio.to_thread(group_running, pgid):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


def read_tail(path: Path, max_bytes: int) -> str:
    """The last `max_bytes` of a log file, decoded leniently ("" if it cannot be read).

    Opened non-blocking and read only if it is a regular file: a task may have replaced
    its log with a FIFO, whose open or read would otherwise block the agent.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        return ""
    try:
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                return ""
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - max_bytes))
            return decode_tail(file.read(max_bytes), truncated=size > max_bytes)
    except OSError:
        return ""


def missing_outputs(workdir: Path, outputs: Sequence[str]) -> tuple[str, ...]:
    """The declared outputs (files or directories) that do not exist, in declared order.

    Only stat()ed, never opened, so a FIFO or device among them cannot block. One that
    cannot be stat()ed at all (no permission, name too long, NUL byte) counts as missing:
    nothing after this step could read it either.
    """
    return tuple(o for o in outputs if not _exists(output_path(workdir, o)))


def _exists(path: str) -> bool:
    try:
        os.stat(path)  # follows symlinks: a dangling one is not an output
    except (OSError, ValueError):
        return False
    return True


# ---------------------------------------------------------------- orphans of an earlier agent


def _pids() -> Iterator[int]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


def _environ(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return file.read()
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def find_task_processes(task_id: str, attempt: int, node_id: str) -> list[int]:
    """Live processes whose environment says they belong to this task attempt on this node.

    The environment, not the pid, identifies them: pids are reused, and a process that
    left its session keeps the M27_* variables it was started with.
    """
    wanted = {f"M27_TASK_ID={task_id}".encode(), f"M27_ATTEMPT={attempt}".encode(),
              f"M27_NODE_ID={node_id}".encode()}
    found: list[int] = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        environ = _environ(pid)
        if environ is None or not wanted.issubset(environ.split(b"\0")):
            continue
        if not _is_zombie(pid):
            found.append(pid)
    return found


def kill_pids(pids: list[int]) -> int:
    """SIGKILL each pid; how many were still there."""
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            continue
    return killed
