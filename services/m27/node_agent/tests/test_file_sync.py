"""Uploads and restores of a step's checkpoint files close the store connection they open."""

from __future__ import annotations

import subprocess
import sys
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


RACE = """
import sys, threading, time, zstandard
from pathlib import Path
from m27.node_agent._checkpoint_files import _plan_file
path, stop = Path(sys.argv[1]), time.monotonic() + 2.0
def rewrite():  # what `echo $n > state` does: truncate, then write
    while time.monotonic() < stop:
        with path.open("wb") as out:
            out.write(b"x" * 8_000_000)
threading.Thread(target=rewrite, daemon=True).start()
compressor, planned = zstandard.ZstdCompressor(level=1), 0
while time.monotonic() < stop:
    _plan_file("state", path, None, compressor)
    planned += 1
print("planned", planned)
"""


def test_a_file_the_step_truncates_while_it_is_read_does_not_kill_the_agent(
        tmp_path: Path) -> None:
    """Found by the soak: two node-agents died of SIGBUS at once — the step rewrote its
    checkpoint file (`echo 3 > state`) while the agent read it through a memory map. In a
    child process, so that the old failure cannot take pytest with it."""
    state = tmp_path / "state"
    state.write_bytes(b"x" * 8_000_000)
    done = subprocess.run([sys.executable, "-c", RACE, str(state)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("planned ")
