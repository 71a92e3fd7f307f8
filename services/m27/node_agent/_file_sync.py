"""A step's own checkpoint files, kept in the checkpoint-store by the agent: which store to
use, the restore before an attempt starts and the uploads while and after it runs.

The file work itself (what to send, what changed, writing restored files durably) is in
`_checkpoint_files`; this is the part that talks to the bus and the store, bounded in time
so that neither a start nor an exit report can hang on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from m27.common import subjects
from m27.common.api_auth import ApiAccess
from m27.common.bus import Bus
from m27.common.checkpoint_api import StorageUnavailable
from m27.common.checkpoint_format import Manifest
from m27.common.checkpoint_storage import CheckpointSink
from m27.common.events import StartTask
from m27.common.logging import get_logger
from m27.common.model import ServiceInfo
from m27.node_agent import _checkpoint_files
from m27.node_agent._tasks import CannotStart

log = get_logger()

CHECKPOINT_STORE_SERVICE: Final = "checkpoint-store"
#: How long a restore before start, and the upload after the step stops, may take before
#: the agent gives up on them (the exit must be reported).
FILES_RESTORE_TIMEOUT_S: Final = 600.0
FILES_FINAL_UPLOAD_TIMEOUT_S: Final = 120.0
PROTECT_TIMEOUT_S: Final = 30.0
#: How long a restore waits out a checkpoint-store that cannot be reached (restarting,
#: moved to another machine by its supervisor), trying again after 0.5, 1, 2 … 5 s.
RESTORE_OUTAGE_S: Final = 120.0


def remote_stores(access: ApiAccess | None = None) -> Callable[[str, str, int], CheckpointSink]:
    """Opens the checkpoint-store at an address for a task attempt, as `access` (the
    agent's `node` token; None: the process's own, `api_auth.default_access`)."""
    def remote_store(address: str, task_id: str, attempt: int) -> CheckpointSink:
        from m27.client.checkpoints import RemoteStore  # the gRPC client, only when needed

        return RemoteStore(address, task_id=task_id, attempt=attempt, access=access)

    return remote_store


@dataclass(frozen=True)
class FileCheckpoints:
    """How the agent keeps the files a step writes into M27_CHECKPOINT_DIR (for steps with
    a `checkpoint:` interval): compression, the size limit, and how to reach the store."""

    level: int = 3
    max_bytes: int = 64 * 1024**3
    open_store: Callable[[str, str, int], CheckpointSink] = field(
        default_factory=remote_stores)


def close(sink: CheckpointSink) -> None:
    """Close a sink that holds a connection (a RemoteStore's gRPC channel; uploads left
    theirs to the garbage collector until the soak's store was looked into); local sinks
    hold none."""
    closer = getattr(sink, "close", None)
    if closer is not None:
        closer()


async def restore_files(open_store: Callable[[str, str, int], CheckpointSink], store: str,
                        task_id: str, attempt: int, checkpoint_dir: Path,
                        outage_s: float = RESTORE_OUTAGE_S) -> Manifest | None:
    """The task's latest uploaded files written into `checkpoint_dir` (None: there are
    none), waiting out a store that cannot be reached for up to `outage_s` (found by the
    chaos suite: a store restarting as a step moved failed the step). CannotStart when
    it cannot be done."""
    loop = asyncio.get_running_loop()
    began, wait = loop.time(), 0.5
    while True:
        sink = open_store(store, task_id, attempt)
        try:
            return await asyncio.wait_for(asyncio.to_thread(
                _checkpoint_files.restore, sink, task_id, checkpoint_dir),
                FILES_RESTORE_TIMEOUT_S)
        except TimeoutError as exc:
            raise CannotStart("restoring the step's checkpoint files took more than "
                              f"{FILES_RESTORE_TIMEOUT_S:.0f}s") from exc
        except StorageUnavailable as exc:
            if loop.time() + wait > began + outage_s:
                raise CannotStart("could not restore the step's checkpoint files: the "
                                  f"checkpoint-store was unreachable for {outage_s:.0f}s: "
                                  f"{exc}") from exc
            log.warning("task.checkpoint_files_restore_waits", error=str(exc)[:300],
                        retry_in_s=wait)
        except Exception as exc:  # the store's errors, OSError, a damaged manifest
            raise CannotStart(f"could not restore the step's checkpoint files: {exc}") from exc
        finally:
            close(sink)
        await asyncio.sleep(wait)
        wait = min(wait * 2, 5.0)


class FileSync:
    """Restore and upload of program-managed checkpoint files for the tasks of one node."""

    def __init__(self, bus: Bus, settings: FileCheckpoints,
                 clock: Callable[[], float]) -> None:
        self._bus = bus
        self._settings = settings
        self._clock = clock

    async def store_address(self) -> str | None:
        """The gRPC address of the newest registered checkpoint-store, if any."""
        prefix = f"{CHECKPOINT_STORE_SERVICE}."
        try:
            keys = [k for k in await self._bus.kv_keys(subjects.SERVICES_BUCKET)
                    if k.startswith(prefix)]
            found = [await self._bus.kv_get(subjects.SERVICES_BUCKET, k, ServiceInfo)
                     for k in keys]
        except Exception as exc:
            log.warning("checkpoint_store.lookup_failed", error=str(exc))
            return None
        infos = [entry[0] for entry in found if entry is not None]
        newest = max(infos, key=lambda info: info.started_at, default=None)
        return newest.grpc_address if newest else None

    async def restore(self, cmd: StartTask, checkpoint_dir: Path, store: str) -> None:
        """An attempt starting where its checkpoint directory is empty (another node, after
        a failover) gets the files the previous attempt uploaded. Failing that, it does not
        start (CannotStart): starting from scratch would silently throw the progress away."""
        if not _checkpoint_files.is_empty(checkpoint_dir):
            return
        restored = await restore_files(self._settings.open_store, store, cmd.task_id,
                                       cmd.attempt, checkpoint_dir)
        if restored is not None:
            log.info("task.checkpoint_files_restored", checkpoint_id=restored.checkpoint_id,
                     files=len(restored.entries), bytes=restored.size_bytes,
                     from_attempt=restored.attempt)

    async def protect(self, cmd: StartTask, store: str | None, before_step: int,
                      before: float, reason: str) -> None:
        """Keep the step's last checkpoint from before a training anomaly out of
        retention (the store's Protect). Logged, never fatal: the anomaly's own checkpoint
        request goes ahead whatever happens here."""
        if not store:
            log.warning("task.checkpoint_not_protected", why="no checkpoint-store")
            return
        sink = self._settings.open_store(store, cmd.task_id, cmd.attempt)
        protect = getattr(sink, "protect", None)
        if protect is None:  # a sink without the RPC (tests' local stores)
            return
        try:
            checkpoint_id = await asyncio.wait_for(
                asyncio.to_thread(protect, before_step, before, reason), PROTECT_TIMEOUT_S)
        except Exception as exc:
            log.warning("task.checkpoint_not_protected", error=str(exc) or type(exc).__name__)
            return
        finally:
            close(sink)
        log.info("task.checkpoint_protected", checkpoint_id=checkpoint_id or None,
                 why="none before the anomaly" if not checkpoint_id else reason)

    async def upload(self, cmd: StartTask, checkpoint_dir: Path, store: str | None,
                     why: str) -> None:
        """Send the step's checkpoint files to the store (only what changed). A failure is
        logged, never fatal: the previous upload stays the one a restart uses."""
        if not cmd.checkpoint_interval_s or not store:
            return
        sink = self._settings.open_store(store, cmd.task_id, cmd.attempt)
        try:
            manifest = await asyncio.wait_for(asyncio.to_thread(
                _checkpoint_files.upload, sink, cmd.task_id, cmd.attempt, checkpoint_dir,
                level=self._settings.level, max_bytes=self._settings.max_bytes,
                now=self._clock()),
                FILES_FINAL_UPLOAD_TIMEOUT_S if why == "exit" else cmd.checkpoint_interval_s)
        except Exception as exc:
            log.warning("task.checkpoint_files_upload_failed", why=why,
                        error=str(exc) or type(exc).__name__)
            return
        finally:
            close(sink)
        if manifest is not None:
            log.info("task.checkpoint_files_uploaded", why=why,
                     checkpoint_id=manifest.checkpoint_id, files=len(manifest.entries),
                     new_bytes=manifest.new_bytes if manifest.attempt == cmd.attempt else 0)
