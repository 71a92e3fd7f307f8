"""`m27 checkpoints`: the table it prints, where a restore writes each entry (never outside
the directory), how it finds the store, and its usage errors."""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import pytest

from m27.cli import build_parser
from m27.cli._checkpoints import (
    MANIFEST_FILE,
    render_list,
    restore_plan,
    stays_inside,
    store_address,
    target_name,
)
from m27.common.checkpoint_api import CheckpointSummary
from m27.common.checkpoint_format import Entry, Manifest
from m27.common.errors import M27Error
from m27.embedded.processes import ServiceProcess
from m27.embedded.system import STATE_FILE, EmbeddedState

RUN = "r-20261201-000000-abcdef"


def summary(checkpoint_id: str, **changes: object) -> CheckpointSummary:
    fields: dict[str, object] = {
        "task_id": f"{RUN}/train", "checkpoint_id": checkpoint_id, "attempt": 1,
        "name": "step-100", "step": 100, "epoch": 2, "created_at": 1000.0,
        "size_bytes": 3 * 1024**3, "new_bytes": 12 * 1024**2, "full": False, "entries": 4}
    fields.update(changes)
    return CheckpointSummary(**fields)  # type: ignore[arg-type]


def test_the_listing_shows_sizes_stored_bytes_kind_and_age() -> None:
    lines = render_list([summary("c-0000000000001-aaaaaa", full=True, new_bytes=3 * 1024**3),
                         summary("c-0000000000002-aaaaaa", name="", step=None, epoch=None,
                                 created_at=1190.0, task_id=f"{RUN}/eval")], now=1250.0)
    assert lines[0].split() == ["STEP", "CHECKPOINT", "NAME", "TRAIN", "STEP", "EPOCH", "SIZE",
                                "STORED", "KIND", "AGE"]
    assert lines[1].split() == ["train", "c-0000000000001-aaaaaa", "step-100", "100", "2",
                                "3.0GiB", "3.0GiB", "full", "4m10s"]
    assert lines[2].split() == ["eval", "c-0000000000002-aaaaaa", "—", "—", "—", "3.0GiB",
                                "12.0MiB", "delta", "1m00s"]
    assert lines[0].index("CHECKPOINT") == lines[1].index("c-") == lines[2].index("c-")


def test_a_protected_checkpoint_is_marked_and_says_why() -> None:
    lines = render_list([
        summary("c-0000000000001-aaaaaa", protected="training anomaly: loss is nan at 7"),
        summary("c-0000000000002-aaaaaa")], now=1250.0)
    assert lines[1].endswith("  [protected]")
    assert not lines[2].endswith("[protected]")
    assert lines[3] == ("[protected] c-0000000000001-aaaaaa: training anomaly: loss is nan "
                        "at 7")


def test_a_finished_runs_listing_says_when_its_checkpoints_go() -> None:
    going = render_list([summary("c-0000000000001-aaaaaa")], now=1250.0)
    assert not any("removed" in line for line in going)
    ended = render_list([summary("c-0000000000001-aaaaaa", removed_at=1250.0 + 86400 * 3)],
                        now=1250.0)
    assert ended[-1].startswith("These checkpoints are removed on ")
    assert "(in 3.0 days)" in ended[-1]
    assert "keep_finished" in ended[-1]
    overdue = render_list([summary("c-0000000000001-aaaaaa", removed_at=1000.0)], now=1250.0)
    assert "(at the next garbage collection)" in overdue[-1]


def entry(name: str, kind: str = "file") -> Entry:
    return Entry(name=name, kind=kind, size=0, chunks=())  # type: ignore[arg-type]


def manifest(*entries: Entry) -> Manifest:
    return Manifest(task_id=f"{RUN}/train", checkpoint_id="c-0000000000001-aaaaaa",
                          entries=entries)


def test_files_keep_their_names_and_tensors_become_bin_files(tmp_path: Path) -> None:
    planned = restore_plan(manifest(entry("sub/dir/state.cpt"), entry("model.w", "tensor"),
                                    entry("rng", "bytes")), tmp_path)
    assert [path for _, path in planned] == [tmp_path / "sub" / "dir" / "state.cpt",
                                             tmp_path / "model.w.bin", tmp_path / "rng.bin"]
    assert target_name(entry("w", "tensor")) == "w.bin"


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", "a/../../b", "a//b", "./a",
                                  "a\x00b", ""])
def test_names_that_would_leave_the_directory_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(M27Error, match="outside"):
        restore_plan(manifest(entry("fine"), entry(name)), tmp_path)


@pytest.mark.parametrize("entries", [(entry("w.bin"), entry("w", "tensor")),
                                     (entry(MANIFEST_FILE),)])
def test_two_entries_on_one_file_are_refused(tmp_path: Path, entries: tuple[Entry, ...]) -> None:
    with pytest.raises(M27Error, match="would overwrite"):
        restore_plan(manifest(*entries), tmp_path)


def test_a_symlink_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "restore"
    root.mkdir()
    (root / "escape").symlink_to(tmp_path)
    stays_inside(root / "new" / "dir", root)
    with pytest.raises(M27Error, match="leads outside"):
        stays_inside(root / "escape" / "x", root)


def test_the_store_is_the_flag_then_the_variable_then_the_embedded_one(tmp_path: Path) -> None:
    env = {"M27_CHECKPOINT_STORE": "10.0.0.5:4100"}
    assert store_address("h:1", env, tmp_path) == "h:1"
    assert store_address(None, env, tmp_path) == "10.0.0.5:4100"
    with pytest.raises(M27Error, match="nothing is running under"):
        store_address(None, {}, tmp_path)
    process = ServiceProcess(name="checkpoint-store", module="m27.checkpoint_store",
                             pid=os.getpid(), log_path="", ready_file="",
                             grpc_address="127.0.0.1:4321")
    state = EmbeddedState(home=str(tmp_path), nats_url="nats://x", nats_pid=os.getpid(),
                          api="127.0.0.1:1", processes=[process], started_at=time.time(),
                          gpus="sim:2", simulated_gpus=True)
    (tmp_path / STATE_FILE).write_bytes(msgspec.json.encode(state))
    assert store_address(None, {}, tmp_path) == "127.0.0.1:4321"
    state.processes = [msgspec.structs.replace(process, pid=2**22 + 12345)]
    (tmp_path / STATE_FILE).write_bytes(msgspec.json.encode(state))
    with pytest.raises(M27Error, match="checkpoint-store is not running"):
        store_address(None, {}, tmp_path)


@pytest.mark.parametrize("argv", [
    ["checkpoints", "restore", RUN, "--to", "d"],
    ["checkpoints", "restore", RUN, "train"],
    ["checkpoints", RUN, "train", "extra"],
    ["checkpoints", RUN, "--to", "d"],
])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(argv)
    with pytest.raises(SystemExit) as caught:
        args.handler(args)
    assert caught.value.code == 2
    assert "m27 checkpoints RUN [STEP]" in capsys.readouterr().err
