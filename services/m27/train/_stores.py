"""Which store a checkpointer writes to: the one it is given, else the checkpoint-store
the node-agent names (M27_CHECKPOINT_STORE), else a directory (M27_CHECKPOINT_DIR inside
m27, ./checkpoints on a laptop)."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from m27.common.checkpoint_api import StorageFull, StorageUnavailable
from m27.common.checkpoint_storage import TRAIN_STORE_SUBDIR, CheckpointSink, LocalStore
from m27.train._log import log

#: How long a checkpoint or a restore waits out a checkpoint-store that cannot be reached
#: (restarting after a crash, moved by Kubernetes) before it fails; training goes on
#: meanwhile and the checkpoints that fall due wait for the one in flight.
STORE_OUTAGE_S: Final = 120.0


def open_store(store: CheckpointSink | str | os.PathLike[str] | None,
               environ: Mapping[str, str], *, task_id: str, attempt: int) -> CheckpointSink:
    if isinstance(store, str | os.PathLike):
        return LocalStore(Path(store))
    if store is not None:
        return store
    address = environ.get("M27_CHECKPOINT_STORE")
    directory = environ.get("M27_CHECKPOINT_DIR")
    if address:
        try:  # imported lazily: a laptop run needs no gRPC stack
            from m27.client.checkpoints import RemoteStore

            sink: CheckpointSink = RemoteStore(address, task_id=task_id, attempt=attempt,
                                               outage_s=STORE_OUTAGE_S)
        except (ImportError, AttributeError) as exc:  # an m27 without the sync client
            log.warning("checkpoint_store_client_missing", address=address, error=str(exc))
        else:
            return sink
    if directory:
        return LocalStore(Path(directory) / TRAIN_STORE_SUBDIR)
    return LocalStore(Path("checkpoints"))


def task_identity(task_id: str | None, environ: Mapping[str, str]) -> tuple[str, int]:
    """(task id, attempt): the node-agent's, else "local" and 0."""
    attempt = environ.get("M27_ATTEMPT", "0")
    return (task_id or environ.get("M27_TASK_ID") or "local",
            int(attempt) if attempt.isdigit() else 0)


def may_pass(error: BaseException | None) -> bool:
    """Is `error` (or what caused it) a checkpoint failure that waiting may cure: the
    checkpoint-store away, or the disk under the checkpoints full?"""
    while error is not None:
        if isinstance(error, StorageFull | StorageUnavailable) or (
                isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)):
            return True
        error = error.__cause__
    return False
