"""Uploads and restores of a step's checkpoint files close the store connection they open."""

from __future__ import annotations

from pathlib import Path

from m27.common.checkpoint_storage import LocalStore
from m27.common.events import StartTask
from m27.common.memory_bus import MemoryBus
from m27.node_agent._file_sync import FileCheckpoints, FileSync, restore_files

TASK = "r-20240101-120000-abc123/train"


class ClosingStore(LocalStore):
    """A local store that counts how often it was closed (a RemoteStore's channel)."""

    closed = 0

    def close(self) -> None:
        ClosingStore.closed += 1


async def test_every_upload_and_restore_closes_the_store_it_opened(tmp_path: Path) -> None:
    opened: list[ClosingStore] = []

    def open_store(address: str, task_id: str, attempt: int) -> ClosingStore:
        opened.append(ClosingStore(tmp_path / "store"))
        return opened[-1]

    ClosingStore.closed = 0
    sync = FileSync(MemoryBus(), FileCheckpoints(open_store=open_store), clock=lambda: 1.0)
    cmd = StartTask(at=0.0, task_id=TASK, run_id=TASK.split("/")[0], step="train", attempt=1,
                    step_type="gpu", command="x", checkpoint_interval_s=1.0)
    files = tmp_path / "files"
    files.mkdir()
    for n in range(3):
        (files / "state").write_bytes(bytes([n]) * 1000)
        await sync.upload(cmd, files, "127.0.0.1:1", why="interval")
    restored = await restore_files(open_store, "127.0.0.1:1", TASK, 2, tmp_path / "other")
    assert restored is not None
    assert (tmp_path / "other" / "state").read_bytes() == bytes([2]) * 1000
    assert len(opened) == 4
    assert ClosingStore.closed == 4
