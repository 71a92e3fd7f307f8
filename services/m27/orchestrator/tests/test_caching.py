"""The cache key and the hit verdict: what makes two steps identical, when a hit counts."""

from __future__ import annotations

from pathlib import Path

import msgspec

from m27.common.model import Resources, RunRecord, StepRecord
from m27.orchestrator.caching import (
    CacheEntry,
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
