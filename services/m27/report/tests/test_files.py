"""write_atomic: a reader sees the old file or the new one, and no temp file is left."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from m27.report import write_atomic


def test_writes_utf8_and_creates_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "r.html"
    write_atomic(path, "héllo ✓\n")
    assert path.read_bytes() == "héllo ✓\n".encode()
    assert list(path.parent.iterdir()) == [path]


def test_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "r.html"
    path.write_text("old")
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert list(tmp_path.iterdir()) == [path]


def test_the_report_is_readable_by_others(tmp_path: Path) -> None:
    path = tmp_path / "r.html"
    write_atomic(path, "x")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    path = tmp_path / "r.html"
    path.write_text("old")

    def boom(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert list(tmp_path.iterdir()) == [path]


def test_the_data_is_fsynced_before_the_rename(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync")
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        calls.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_atomic(tmp_path / "r.html", "x")
    # file, rename, then the directory entry
    assert calls == ["fsync", "replace", "fsync"]
