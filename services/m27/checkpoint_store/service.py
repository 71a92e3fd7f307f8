"""The checkpoint-store process: where chunks live, the serve loop and periodic GC."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import msgspec

from m27.checkpoint_store._chunks import ChunkStore
from m27.checkpoint_store._index import KvManifestIndex, nats_errors
from m27.checkpoint_store._retention import RetentionPolicy
from m27.checkpoint_store._store import CheckpointStore
from m27.checkpoint_store.api import SERVICE_NAME, CheckpointServicer, register
from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.common.checkpoint_api import CheckpointStoreError
from m27.common.config import Config
from m27.common.ids import split_task_id
from m27.common.logging import get_logger
from m27.common.model import TERMINAL_RUN_STATES, Fence, StoredRunEnd
from m27.common.service import ServiceRuntime

log = get_logger()


def checkpoint_root(config: Config, home: Path) -> Path:
    """`[checkpoint] dir`, or `$M27_HOME/checkpoints` when it is empty."""
    configured = config.checkpoint.dir
    root = Path(configured).expanduser() if configured else home / "checkpoints"
    return root.absolute()


def build_store(root: Path, bus: NatsBus, config: Config) -> CheckpointStore:
    section = config.checkpoint

    async def assigned_attempt(task_id: str) -> int | None:
        with nats_errors("read the task's fencing token"):
            got = await bus.kv_get(subjects.FENCES_BUCKET, subjects.task_key(task_id), Fence)
        return got[0].attempt if got else None

    async def run_ended(run_id: str) -> float | None:
        """When the run ended; None while it has not, or when its record is missing or
        unreadable (its checkpoints are kept)."""
        try:
            with nats_errors("read the run's record"):
                got = await bus.kv_get(subjects.RUNS_BUCKET, run_id, StoredRunEnd)
        except msgspec.DecodeError as exc:  # a validation error too
            log.warning("checkpoint.run_unreadable", run_id=run_id, error=str(exc))
            return None
        if got is None or got[0].run.state not in TERMINAL_RUN_STATES:
            return None
        return got[0].run.ended_at

    async def publish(event: events.CheckpointCorrupt) -> None:
        run_id, step = split_task_id(event.task_id)
        subject = subjects.task_events(run_id, step, subjects.CHECKPOINT_STORE_SENDER)
        await bus.publish(subject, event,
                          msg_id=f"checkpoint-corrupt:{event.checkpoint_id}:{event.chunk_id}")

    async def announce(event: events.CheckpointCommitted) -> None:
        run_id, step = split_task_id(event.task_id)
        subject = subjects.task_events(run_id, step, subjects.CHECKPOINT_STORE_SENDER)
        await bus.publish(subject, event,
                          msg_id=f"checkpoint-committed:{event.checkpoint_id}")

    return CheckpointStore(
        ChunkStore(root), KvManifestIndex(bus), max_bytes=section.max_size,
        retention=RetentionPolicy(keep_last=section.keep_last, keep_every=section.keep_every),
        gc_grace_s=section.gc_grace, keep_finished_s=section.keep_finished,
        run_ended=run_ended, assigned_attempt=assigned_attempt, on_corrupt=publish,
        on_commit=announce)


async def collect_garbage(store: CheckpointStore, interval_s: float,
                          stop: asyncio.Event) -> None:
    """At start and every `interval_s`; a failed round is logged and tried again later."""
    while not stop.is_set():
        try:
            report = await store.collect_garbage()
        except CheckpointStoreError as exc:
            log.warning("checkpoint.gc_failed", error=str(exc))
        except Exception as exc:  # a GC bug must not stop checkpoints being served
            log.exception("checkpoint.gc_crashed", error=repr(exc))
        else:
            log.info("checkpoint.gc_done", manifests=report.manifests, expired=report.expired,
                     referenced=report.referenced, young=report.young, deleted=report.deleted,
                     freed_bytes=report.freed_bytes, temp_removed=report.temp_removed)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def serve(rt: ServiceRuntime) -> None:
    """Prepare the store, serve gRPC, collect garbage, and wait for the stop signal."""
    root = checkpoint_root(rt.config, rt.home)
    await rt.connect()
    store = await asyncio.to_thread(build_store, root, rt.nats, rt.config)
    removed = await store.prepare()
    section = rt.config.checkpoint
    log.info("checkpoint.store_opened", root=str(root), temp_files_removed=removed,
             max_bytes=store.max_bytes, keep_last=section.keep_last,
             keep_every=section.keep_every, gc_interval_s=section.gc_interval,
             gc_grace_s=section.gc_grace, keep_finished_s=section.keep_finished)
    await rt.serve_grpc([register(CheckpointServicer(store))], [SERVICE_NAME])
    await rt.ready()
    if section.gc_interval > 0:
        rt.spawn(collect_garbage(store, section.gc_interval, rt.stop), "checkpoint-gc")
    await rt.stop.wait()
