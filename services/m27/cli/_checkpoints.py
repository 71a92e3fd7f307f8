"""`m27 checkpoints RUN [STEP]` lists checkpoints; `m27 checkpoints restore RUN STEP --to DIR`
writes one into a directory.

Rendering and where each entry goes are pure; the commands only fetch and write. A restore
writes files under their own names, tensors and blobs as `<name>.bin`, and the manifest as
`manifest.json`; a name that would leave DIR is refused before anything is written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final

import msgspec
import zstandard

from m27.cli._common import Subparsers, add, print_json, service_address, when
from m27.cli._live import progress
from m27.client.checkpoints import RemoteStore
from m27.common.checkpoint_api import CheckpointSummary, StorageUnavailable
from m27.common.checkpoint_format import ChunkRef, Entry, Manifest, decode_chunk
from m27.common.errors import M27Error
from m27.common.units import format_duration, format_size

STORE_ENV: Final = "M27_CHECKPOINT_STORE"
PROCESS_NAME: Final = "checkpoint-store"
MANIFEST_FILE: Final = "manifest.json"
CHUNKS_PER_FETCH: Final = 16
NONE: Final = "—"
USAGE: Final = """m27 checkpoints RUN [STEP] [--json]
       m27 checkpoints restore RUN STEP [--id ID] --to DIR"""
HEADER: Final = ("STEP", "CHECKPOINT", "NAME", "TRAIN STEP", "EPOCH", "SIZE", "STORED",
                 "KIND", "AGE")


def add_commands(sub: Subparsers) -> None:
    parser = add(sub, "checkpoints", "list a run's checkpoints (step, size, bytes actually "
                 "stored, full or delta, age), or restore one into a directory", cmd_checkpoints)
    parser.usage = USAGE
    parser.set_defaults(usage_error=parser.error)
    parser.add_argument("words", nargs="+", metavar="RUN [STEP]",
                        help="a run (and one of its steps); `restore RUN STEP` restores")
    parser.add_argument("--json", action="store_true", help="machine-readable listing")
    parser.add_argument("--id", default="", metavar="ID",
                        help="restore this checkpoint (default: the latest good one)")
    parser.add_argument("--to", type=Path, metavar="DIR", help="restore into this directory")
    parser.add_argument("--checkpoint-store", metavar="HOST:PORT",
                        help=f"the checkpoint-store (default: ${STORE_ENV}, else the "
                        "embedded system's)")


def cmd_checkpoints(args: argparse.Namespace) -> int:
    words: list[str] = args.words
    if words[0] == "restore":
        if len(words) != 3 or args.to is None or args.json:
            args.usage_error("restore takes RUN STEP and --to DIR (and no --json)")
        return _restore(args, words[1], words[2])
    if len(words) > 2 or args.to is not None or args.id:
        args.usage_error("a listing takes RUN [STEP]; --id and --to are for "
                         "`m27 checkpoints restore`")
    return _list(args, words[0], words[1] if len(words) == 2 else "")


def store_address(explicit: str | None, environ: Mapping[str, str], home: Path) -> str:
    """--checkpoint-store, $M27_CHECKPOINT_STORE, else the embedded system's process."""
    return service_address(explicit, environ, home, variable=STORE_ENV,
                           process=PROCESS_NAME, flag="--checkpoint-store")


@contextlib.contextmanager
def connected(args: argparse.Namespace) -> Iterator[RemoteStore]:
    address = store_address(args.checkpoint_store, os.environ, args.home)
    store = RemoteStore(address, task_id="", timeout_s=60)
    try:
        yield store
    except StorageUnavailable as exc:
        raise M27Error(f"cannot reach the checkpoint-store at {address}: {exc}") from None
    finally:
        store.close()


def _list(args: argparse.Namespace, run_id: str, step: str) -> int:
    with connected(args) as store:
        found = store.summaries(task_id=f"{run_id}/{step}", with_removal=True) if step \
            else store.summaries(run_id=run_id, with_removal=True)
    if args.json:
        print_json(found)
        return 0
    if not found:
        print(f"no checkpoints of {run_id}{'/' + step if step else ''}")
        return 0
    print("\n".join(render_list(found, time.time())))
    return 0


def render_list(summaries: Sequence[CheckpointSummary], now: float) -> list[str]:
    """A table, oldest first per step."""
    rows = [HEADER] + [(
        s.task_id.partition("/")[2], s.checkpoint_id, s.name or NONE,
        NONE if s.step is None else str(s.step), NONE if s.epoch is None else str(s.epoch),
        format_size(s.size_bytes), format_size(s.new_bytes), "full" if s.full else "delta",
        format_duration(max(0.0, now - s.created_at))) for s in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    # a protected one is marked on its line and says why below the table
    for index, summary in enumerate(summaries, start=1):
        if summary.protected:
            lines[index] += "  [protected]"
    lines += [f"[protected] {s.checkpoint_id}: {s.protected}" for s in summaries if s.protected]
    # one run's checkpoints all go together, keep_finished after it ended
    removal = min((s.removed_at for s in summaries if s.removed_at is not None), default=None)
    if removal is not None:
        left = removal - now
        due = "at the next garbage collection" if left <= 0 else \
            f"in {left / 86400:.1f} days" if left >= 2 * 86400 else f"in {format_duration(left)}"
        lines.append(f"These checkpoints are removed on {when(removal)} ({due}): the run "
                     "has ended, and the store keeps a finished run's checkpoints for "
                     "[checkpoint] keep_finished. Restore what you want to keep with "
                     "`m27 checkpoints restore`.")
    return lines


def target_name(entry: Entry) -> str:
    return entry.name if entry.kind == "file" else f"{entry.name}.bin"


def restore_plan(manifest: Manifest, root: Path) -> list[tuple[Entry, Path]]:
    """Where each entry goes under `root`; M27Error for a name that would leave it, or two
    entries (or one and `manifest.json`) that would land on the same file."""
    planned: list[tuple[Entry, Path]] = []
    taken = {MANIFEST_FILE}
    for entry in manifest.entries:
        name = target_name(entry)
        parts = name.split("/")
        if name.startswith("/") or "\x00" in name or any(p in {"", ".", ".."} for p in parts):
            raise M27Error(f"checkpoint entry {entry.name[:80]!r} would be written outside "
                           f"{root}; refusing to restore")
        if name in taken:
            raise M27Error(f"checkpoint entry {entry.name[:80]!r} would overwrite {name}")
        taken.add(name)
        planned.append((entry, root.joinpath(*parts)))
    return planned


def _restore(args: argparse.Namespace, run_id: str, step: str) -> int:
    root: Path = args.to.expanduser().absolute()
    task_id = f"{run_id}/{step}"
    with connected(args) as store:
        manifest = store.get_manifest(task_id, args.id)
        planned = restore_plan(manifest, root)
        root.mkdir(parents=True, exist_ok=True)
        with progress(sys.stderr, data=True) as bars:
            bar = bars.add_task(f"restoring {manifest.checkpoint_id}",
                                total=sum(entry.size for entry, _ in planned))
            for entry, path in planned:
                write_entry(store, entry, path, root,
                            advance=lambda size: bars.advance(bar, size))
    write_atomically(root / MANIFEST_FILE, json.dumps(
        msgspec.to_builtins(manifest), indent=2).encode() + b"\n", 0o644)
    training = f", training step {manifest.step}" if manifest.step is not None else ""
    print(f"restored {len(planned)} entries ({format_size(manifest.size_bytes)}) of {task_id} "
          f"checkpoint {manifest.checkpoint_id}{training} into {root}")
    return 0


def write_entry(store: RemoteStore, entry: Entry, path: Path, root: Path,
                advance: Callable[[int], object] = lambda _size: None) -> None:
    """Fetch and decode the entry a few chunks at a time (never the whole entry in memory),
    verified, into a temp file renamed into place; `advance` is told each part's size."""
    stays_inside(path.parent, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    stays_inside(path.parent, root)
    unzip = zstandard.ZstdDecompressor()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("wb") as file:
            for start in range(0, len(entry.chunks), CHUNKS_PER_FETCH):
                refs = entry.chunks[start:start + CHUNKS_PER_FETCH]
                fetched = dict(store.read_chunks(sorted(_ids(refs))))
                for ref in refs:
                    advance(file.write(decode_chunk(ref, fetched.__getitem__, unzip)))
        os.chmod(tmp, (entry.mode & 0o777) if entry.kind == "file" and entry.mode else 0o644)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def stays_inside(folder: Path, root: Path) -> None:
    """`folder` (as far as it exists) must not lead outside `root`, e.g. by a symlink."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.resolve().is_relative_to(root.resolve()):
        raise M27Error(f"{folder} leads outside {root} (a symlink?); refusing to write there")


def _ids(refs: Sequence[ChunkRef]) -> set[str]:
    found: set[str] = set()
    for ref in refs:
        node: ChunkRef | None = ref
        while node is not None:
            found.add(node.id)
            node = node.base
    return found


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
