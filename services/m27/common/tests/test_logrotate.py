"""Size-based rotation of a service's own log file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from m27.common.errors import ConfigError
from m27.common.logrotate import RotatingLog, from_environment


def test_the_log_rotates_by_size_keeps_the_newest_files_and_moves_every_fd(
        tmp_path: Path) -> None:
    path = tmp_path / "svc.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    other = os.dup(fd)  # as stdout and stderr both point at the file
    try:
        log = RotatingLog(path, max_bytes=100, keep=2, fds=(other, fd))
        for n in range(12):
            log.write(f'{{"n": {n}, "pad": "{"x" * 30}"}}')  # 45 bytes a line, and
            log.write("\n")  # its newline on its own, as print() writes it
        os.write(other, b"after\n")  # what the interpreter prints lands in the new file
    finally:
        os.close(fd)
        os.close(other)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["svc.log", "svc.log.1", "svc.log.2"]
    assert (tmp_path / "svc.log").read_text().endswith("after\n")
    assert all(p.stat().st_size <= 100 + 45 for p in tmp_path.iterdir())
    kept = "".join((tmp_path / n).read_text() for n in ("svc.log.2", "svc.log.1", "svc.log"))
    lines = kept.splitlines()
    assert all(line.startswith("{") for line in lines[:-1])  # no line split by a rotation
    numbers = [int(line.split(",")[0].split(":")[1]) for line in lines[:-1]]
    assert numbers == list(range(numbers[0], 12))  # the newest, in order, none lost between


def test_the_environment_names_the_file_and_bad_limits_are_clear_errors() -> None:
    assert from_environment({}) is None
    log = from_environment({"M27_LOG_FILE": "/x/s.log", "M27_LOG_MAX_BYTES": "2048",
                            "M27_LOG_KEEP": "5"})
    assert log is not None
    assert (log.path, log.max_bytes, log.keep) == (Path("/x/s.log"), 2048, 5)
    with pytest.raises(ConfigError, match="M27_LOG_MAX_BYTES='lots': expected a whole"):
        from_environment({"M27_LOG_FILE": "/x", "M27_LOG_MAX_BYTES": "lots"})
    with pytest.raises(ConfigError, match="M27_LOG_MAX_BYTES=10: must be at least 1024"):
        from_environment({"M27_LOG_FILE": "/x", "M27_LOG_MAX_BYTES": "10"})
