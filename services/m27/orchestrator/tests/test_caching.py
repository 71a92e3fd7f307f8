"""The cache key and the hit verdict: what makes two steps identical, when a hit counts."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import msgspec
import pytest

from m27.common.memory_bus import MemoryBus
from m27.common.model import Resources, RunRecord, StepRecord
from m27.orchestrator.caching import (
    Cache,
    CacheEntry,
    NotCacheable,
    OutputRecord,
    _Digests,
    cache_key,
    cacheable,
    digest_path,
    verdict,
)

STEP = StepRecord(name="train", type="gpu", command="python train.py", outputs=("m.pt",),
                  inputs=("data.csv",), resources=Resources(gpus=1.0))
RUN = RunRecord(run_id="r-20261201-000000-abcdef", name="p", user="u", urgency="normal",
                state="queued", created_at=0.0, steps=(STEP,), workdir="/lab")


def test_the_key_follows_everything_that_shapes_the_results() -> None:
    base = cache_key(RUN, STEP, {"/lab/data.csv": "d1"})
    assert base == cache_key(RUN, STEP, {"/lab/data.csv": "d1"})
    changes = [
        (RUN, msgspec.structs.replace(STEP, command="python train.py --lr 1"), "d1"),
        (RUN, msgspec.structs.replace(STEP, resources=Resources(gpus=2.0)), "d1"),
        (RUN, msgspec.structs.replace(STEP, env={"SEED": "2"}), "d1"),
        (RUN, msgspec.structs.replace(STEP, outputs=("other.pt",)), "d1"),
        (msgspec.structs.replace(RUN, workdir="/elsewhere"), STEP, "d1"),
        (RUN, STEP, "d2"),
    ]
    keys = {cache_key(run, step, {"/lab/data.csv": digest}) for run, step, digest in changes}
    assert base not in keys
    assert len(keys) == len(changes)


def test_only_steps_with_outputs_and_a_workdir_are_reusable() -> None:
    assert cacheable(RUN, STEP) == ""
    assert "declares no outputs" in cacheable(RUN, msgspec.structs.replace(STEP, outputs=()))
    assert "working directory" in cacheable(msgspec.structs.replace(RUN, workdir=""), STEP)
    assert "--no-cache" in cacheable(msgspec.structs.replace(RUN, use_cache=False), STEP)


def test_a_hit_needs_every_recorded_output_unchanged() -> None:
    entry = CacheEntry(task_id="r-x/train", created_at=0.0,
                       outputs=(OutputRecord(path="/lab/m.pt", digest="a"),))
    assert verdict(entry, {"/lab/m.pt": "a"}) is not None
    assert verdict(entry, {"/lab/m.pt": "b"}) is None
    assert verdict(entry, {"/lab/m.pt": None}) is None
    assert verdict(None, {}) is None


def test_digests_of_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("1")
    (tmp_path / "f").write_text("1")
    before = digest_path(str(tmp_path / "d"))
    assert digest_path(str(tmp_path / "f")) != before
    (tmp_path / "d" / "x").write_text("2")
    assert digest_path(str(tmp_path / "d")) != before
    digests = _Digests()
    assert digests.of_all([str(tmp_path / "f"), str(tmp_path / "none")])[
        str(tmp_path / "none")] is None


# ---------------------------------------------------------------- hostile paths (issue 14)


@pytest.mark.timeout(10)
def test_a_device_a_fifo_or_a_socket_is_never_read(tmp_path: Path) -> None:
    """`inputs: [/dev/zero]` used to hash forever; now it is refused without a read."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "sock"))
        for path in ("/dev/zero", "/dev/urandom", str(fifo), str(tmp_path / "sock")):
            with pytest.raises(OSError, match="not a regular file or directory"):
                digest_path(path)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "ok").write_text("1")
    (tree / "zero").symlink_to("/dev/zero")  # inside a directory: left out, not read
    assert digest_path(str(tree)) == digest_path(str(tree))


def test_hashing_stops_at_its_byte_and_time_budget(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * (3 * 1024 * 1024))
    with pytest.raises(OSError, match="more than"):
        digest_path(str(big), max_bytes=2 * 1024 * 1024)
    with pytest.raises(OSError, match="took more than"):
        digest_path(str(big), max_s=-1.0)
    assert digest_path(str(big)) == hashlib.sha256(big.read_bytes()).hexdigest()


def test_a_step_reading_a_device_is_simply_not_cached(tmp_path: Path) -> None:
    step = msgspec.structs.replace(STEP, inputs=("/dev/zero",))
    run = msgspec.structs.replace(RUN, steps=(step,), workdir=str(tmp_path))
    cache = Cache(MemoryBus())
    with pytest.raises(NotCacheable, match="input /dev/zero cannot be hashed: /dev/zero: not "
                                           "a regular file"):
        cache._key(run, step)
