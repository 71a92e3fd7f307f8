"""Ready-pool staging reads regular files ahead, within limits, never through links or
into FIFOs, and says what was missing."""

from __future__ import annotations

import os
from pathlib import Path

from m27.node_agent._staging import stage_inputs


def tree(root: Path) -> Path:
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "a.bin").write_bytes(b"a" * 1000)
    (root / "data" / "sub" / "b.bin").write_bytes(b"b" * 200)
    (root / "one.txt").write_bytes(b"c" * 30)
    return root


def test_files_and_directories_are_read_ahead_and_missing_ones_listed(tmp_path: Path) -> None:
    root = tree(tmp_path)
    staged = stage_inputs([str(root / "data"), str(root / "one.txt"), str(root / "nope")])
    assert (staged.files, staged.bytes, staged.skipped) == (3, 1230, 0)
    assert staged.missing == (str(root / "nope"),)
    assert staged.seconds >= 0


def test_links_are_not_followed_and_fifos_not_opened(tmp_path: Path) -> None:
    root = tree(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s" * 5000)
    (root / "data" / "link").symlink_to(outside, target_is_directory=True)
    (root / "data" / "file-link").symlink_to(outside / "secret")
    os.mkfifo(root / "data" / "pipe")  # opening it for reading would block for ever
    (root / "data" / "loop").symlink_to(root / "data", target_is_directory=True)
    staged = stage_inputs([str(root / "data")])
    assert (staged.files, staged.bytes) == (2, 1200)
    assert staged.skipped == 4  # two links to outside, the FIFO, the loop


def test_limits_bound_what_is_read(tmp_path: Path) -> None:
    root = tree(tmp_path)
    paths = [str(root / "data"), str(root / "one.txt")]
    by_bytes = stage_inputs(paths, max_bytes=1100)
    assert (by_bytes.files, by_bytes.bytes, by_bytes.skipped) == (2, 1030, 1)
    by_count = stage_inputs(paths, max_files=1)
    assert (by_count.files, by_count.skipped) == (1, 2)


def test_hostile_paths_are_missing_not_errors(tmp_path: Path) -> None:
    staged = stage_inputs(["bad\0name", str(tmp_path / ("x" * 5000)), ""])
    assert staged.files == 0
    assert len(staged.missing) == 3
