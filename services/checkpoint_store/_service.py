"""The checkpoint-store process: flags, where blobs live, and the serve loop."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from m27.checkpoint_store._blobs import FileBlobStore
from m27.checkpoint_store._index import KvRecordIndex
from m27.checkpoint_store._servicer import SERVICE_NAME, CheckpointServicer, register
from m27.checkpoint_store._store import CheckpointStore
from m27.common import subjects
from m27.common.config import Config
from m27.common.logging import get_logger
from m27.common.model import Fence
from m27.common.paths import m27_home
from m27.common.service import ServiceRuntime, run_service, service_parser
from m27.common.units import parse_size

log = get_logger()


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("checkpoint_store",
                            "Stores and returns checkpoint blobs per task, over gRPC.")
    parser.add_argument("--root", metavar="DIR",
                        help="where checkpoint blobs are kept ([checkpoint] dir; "
                        "default: $M27_HOME/checkpoints)")
    parser.add_argument("--max-size", metavar="SIZE", type=_size,
                        help="the largest checkpoint accepted, e.g. 64GiB "
                        "([checkpoint] max_size; default: 64GiB)")
    return parser


def checkpoint_root(config: Config) -> Path:
    """`[checkpoint] dir`, or `$M27_HOME/checkpoints` when it is empty."""
    configured = config.checkpoint.dir
    root = Path(configured).expanduser() if configured else m27_home() / "checkpoints"
    return root.absolute()


async def serve(rt: ServiceRuntime) -> None:
    """Recover the store, serve gRPC, and wait for the stop signal."""
    root = checkpoint_root(rt.config)
    await rt.connect()
    max_bytes = rt.config.checkpoint.max_size
    bus = rt.nats

    async def assigned_attempt(task_id: str) -> int | None:
        got = await bus.kv_get(subjects.FENCES_BUCKET, subjects.task_key(task_id), Fence)
        return got[0].attempt if got else None

    store = CheckpointStore(FileBlobStore(root), KvRecordIndex(bus), max_bytes=max_bytes,
                            assigned_attempt=assigned_attempt)
    removed = await store.recover()
    log.info("checkpoint.store_opened", root=str(root), temp_files_removed=removed,
             max_bytes=max_bytes)
    await rt.serve_grpc([register(CheckpointServicer(store))], [SERVICE_NAME])
    await rt.ready()
    await rt.stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    run_service("checkpoint-store", args, {("checkpoint", "dir"): args.root,
                                           ("checkpoint", "max_size"): args.max_size}, serve)
