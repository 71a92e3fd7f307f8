"""`m27 checkpoints` as users run it, against a real checkpoint-store and nats-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zstandard

from m27.client.checkpoints import RemoteStore
from m27.common.checkpoint_format import Manifest, plan_entry
from m27.embedded.processes import ServiceProcess

pytestmark = pytest.mark.integration

RUN = "r-20240101-120000-abc123"
TASK = f"{RUN}/train"
ZSTD = zstandard.ZstdCompressor(level=3)
StartService = Callable[..., ServiceProcess]


def m27(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "m27.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def commit(store: RemoteStore, contents: dict[str, tuple[str, bytes]],
           previous: Manifest | None, step: int) -> Manifest:
    entries, chunks = [], {}
    for name, (kind, data) in contents.items():
        before = previous.entry(name) if previous else None
        entry, new = plan_entry(name, kind, memoryview(data), before,  # type: ignore[arg-type]
                                delta=False, compressor=ZSTD, chunk_bytes=128 * 1024,
                                mode=0o640)
        entries.append(entry)
        chunks.update(new)
    absent = store.missing(sorted(chunks))
    store.put_chunks({k: v for k, v in chunks.items() if k in absent})
    return store.commit(Manifest(task_id=TASK, step=step, epoch=step // 10,
                                 name=f"step-{step}", entries=tuple(entries)))


@pytest.fixture
def store_proc(start_service: StartService, tmp_path: Path) -> ServiceProcess:
    return start_service("checkpoint_store", "--root", str(tmp_path / "ckpt"))


def test_list_and_restore_through_the_cli(store_proc: ServiceProcess, tmp_path: Path) -> None:
    weights = np.random.default_rng(0).standard_normal(300_000).astype(np.float32).tobytes()
    first_files = {"model.w": ("tensor", weights), "opt/state.cpt": ("file", b"A" * 5000),
                   "rng": ("bytes", b"\x01\x02")}
    with RemoteStore(store_proc.grpc_address, task_id=TASK, attempt=0) as store:
        first = commit(store, first_files, None, step=10)
        second_files = dict(first_files, **{"opt/state.cpt": ("file", b"B" * 5000)})
        second = commit(store, second_files, first, step=20)
    address = ["--checkpoint-store", store_proc.grpc_address]

    listing = m27("checkpoints", RUN, *address)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].split()[:3] == ["STEP", "CHECKPOINT", "NAME"]
    assert [line.split()[:5] for line in lines[1:]] == [
        ["train", first.checkpoint_id, "step-10", "10", "1"],
        ["train", second.checkpoint_id, "step-20", "20", "2"]]
    assert "full" in lines[2]
    assert second.new_bytes < first.new_bytes / 10

    as_json = m27("checkpoints", RUN, "train", "--json",
                  env={"M27_CHECKPOINT_STORE": store_proc.grpc_address})
    assert as_json.returncode == 0, as_json.stderr
    rows = json.loads(as_json.stdout)
    assert [(r["checkpoint_id"], r["step"], r["new_bytes"]) for r in rows] == [
        (first.checkpoint_id, 10, first.new_bytes), (second.checkpoint_id, 20, second.new_bytes)]

    latest_dir = tmp_path / "latest"
    restored = m27("checkpoints", "restore", RUN, "train", "--to", str(latest_dir), *address)
    assert restored.returncode == 0, restored.stderr
    assert f"checkpoint {second.checkpoint_id}, training step 20" in restored.stdout
    assert (latest_dir / "model.w.bin").read_bytes() == weights
    assert (latest_dir / "opt" / "state.cpt").read_bytes() == b"B" * 5000
    assert (latest_dir / "opt" / "state.cpt").stat().st_mode & 0o777 == 0o640
    assert (latest_dir / "rng.bin").read_bytes() == b"\x01\x02"
    saved = json.loads((latest_dir / "manifest.json").read_text())
    assert (saved["checkpoint_id"], saved["step"]) == (second.checkpoint_id, 20)

    older = tmp_path / "older"
    by_id = m27("checkpoints", "restore", RUN, "train", "--id", first.checkpoint_id,
                "--to", str(older), *address)
    assert by_id.returncode == 0, by_id.stderr
    assert (older / "opt" / "state.cpt").read_bytes() == b"A" * 5000


def test_cli_errors_are_one_line(store_proc: ServiceProcess, tmp_path: Path) -> None:
    address = ["--checkpoint-store", store_proc.grpc_address]
    empty = m27("checkpoints", RUN, *address)
    assert (empty.returncode, empty.stdout.strip()) == (0, f"no checkpoints of {RUN}")
    cases = [
        (m27("checkpoints", "../../etc", *address), "run_id must look like"),
        (m27("checkpoints", "restore", RUN, "train", "--to", str(tmp_path / "x"), *address),
         "has no checkpoints"),
        (m27("checkpoints", RUN, "--checkpoint-store", "127.0.0.1:1"),
         "cannot reach the checkpoint-store at 127.0.0.1:1"),
        (m27("checkpoints", RUN, env={"M27_HOME": str(tmp_path / "nothing"),
                                      "M27_CHECKPOINT_STORE": ""}),
         "nothing is running under"),
    ]
    for result, message in cases:
        assert result.returncode == 1, result.stdout
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stderr.startswith("m27: ")
        assert message in result.stderr
        assert "Traceback" not in result.stderr
