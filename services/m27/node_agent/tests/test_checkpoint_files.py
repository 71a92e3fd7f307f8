"""Uploading and restoring the checkpoint files of programs that only write files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from m27.common.checkpoint_storage import LocalStore
from m27.node_agent._checkpoint_files import (
    checkpoint_files,
    is_empty,
    restore,
    safe_target,
    upload,
)

TASK = "r-20261201-000000-abcdef/md"


def write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def test_files_round_trip_and_unchanged_ones_are_not_sent_again(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    source = tmp_path / "node-a"
    write(source, {"state.cpt": os.urandom(300_000), "sub/frame.trr": b"x" * 10_000})
    first = upload(store, TASK, 1, source, level=3, max_bytes=1 << 30, now=1.0)
    assert first is not None
    assert first.new_bytes > 0
    assert upload(store, TASK, 1, source, level=3, max_bytes=1 << 30, now=2.0) == first
    (source / "sub/frame.trr").write_bytes(b"y" * 10_000)
    second = upload(store, TASK, 1, source, level=3, max_bytes=1 << 30, now=3.0)
    assert second is not None
    assert second.new_bytes < 1000  # state.cpt was not sent again
    target = tmp_path / "node-b"
    assert is_empty(target)
    restored = restore(store, TASK, target)
    assert restored == second
    assert (target / "state.cpt").read_bytes() == (source / "state.cpt").read_bytes()
    assert (target / "sub/frame.trr").read_bytes() == b"y" * 10_000


def test_symlinks_and_the_librarys_own_store_are_not_uploaded(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    write(root, {"a.cpt": b"1", "m27-train/chunks/ab/x": b"2", "empty.log": b""})
    (root / "link").symlink_to("/etc/passwd")
    assert [name for name, _ in checkpoint_files(root, 1 << 20)] == ["a.cpt", "empty.log"]
    with pytest.raises(ValueError, match="more than 0 bytes"):
        list(checkpoint_files(root, 0))
    store = LocalStore(tmp_path / "store")
    uploaded = upload(store, TASK, 1, root, level=3, max_bytes=1 << 20, now=1.0)
    assert uploaded is not None
    assert [e.name for e in uploaded.entries] == ["a.cpt", "empty.log"]
    restore(store, TASK, tmp_path / "back")
    assert (tmp_path / "back" / "empty.log").read_bytes() == b""


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b", ""])
def test_names_never_leave_the_directory(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="would leave the directory"):
        safe_target(tmp_path, name)


def test_nothing_to_upload_and_nothing_to_restore(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    assert upload(store, TASK, 1, tmp_path / "missing", level=3, max_bytes=1, now=0) is None
    (tmp_path / "empty").mkdir()
    assert upload(store, TASK, 1, tmp_path / "empty", level=3, max_bytes=1, now=0) is None
    assert restore(store, TASK, tmp_path / "out") is None
