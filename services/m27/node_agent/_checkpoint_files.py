"""Checkpoints of programs that only write files (GROMACS `-cpt`, any `--save-dir`).

A step that does not use `m27.train` may still write its restart files into
M27_CHECKPOINT_DIR. The agent uploads that directory to the checkpoint-store as a manifest
of file entries — at every `checkpoint:` interval (before asking for the next checkpoint, so
the previous one is complete) and when the step ends — and, when an attempt starts on a
node whose copy of the directory is empty (another machine, after a failover), restores
the latest one first. Unchanged files (and unchanged chunks of changed ones) are not sent
again. The directory `m27.train` keeps its own store in when no checkpoint-store is known
(`m27-train/`) is left alone: such a step stores its checkpoints itself.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import zstandard

from m27.common.checkpoint_format import Entry, Manifest, plan_entry, read_entry
from m27.common.checkpoint_storage import TRAIN_STORE_SUBDIR, CheckpointSink, write_durably

LIBRARY_DIRS: Final = frozenset({TRAIN_STORE_SUBDIR})
FILES_LABEL: Final = "files"


def checkpoint_files(root: Path, max_bytes: int) -> Iterator[tuple[str, Path]]:
    """Regular files under `root` (relative name, path); no symlinks followed, the
    library's own store layout skipped. ValueError past `max_bytes` in total."""
    total = 0
    for folder, dirs, files in os.walk(root, followlinks=False):
        here = Path(folder)
        if here == root:
            dirs[:] = [d for d in dirs if d not in LIBRARY_DIRS]
        dirs.sort()
        for name in sorted(files):
            path = here / name
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or name.startswith(".tmp-"):
                continue
            total += info.st_size
            if total > max_bytes:
                raise ValueError(f"{root} holds more than {max_bytes} bytes of checkpoint files")
            yield str(path.relative_to(root)), path


def upload(sink: CheckpointSink, task_id: str, attempt: int, root: Path, *,
           level: int, max_bytes: int, now: float) -> Manifest | None:
    """Store the directory's files as a checkpoint; None when there is nothing to store.

    One file at a time (read into memory: the agent's peak is about the largest file plus
    its new chunks), its new chunks sent before the next file is read; the manifest is
    committed last, so a crash leaves the previous one."""
    if not root.is_dir():
        return None
    files = list(checkpoint_files(root, max_bytes))
    if not files:
        return None
    previous = _latest_files(sink, task_id)
    compressor = zstandard.ZstdCompressor(level=level)
    entries: list[Entry] = []
    sent = 0
    for name, path in files:
        before = previous.entry(name) if previous else None
        entry, new = _plan_file(name, path, before, compressor)
        entries.append(entry)
        absent = sink.missing(sorted(new)) if new else set()
        if absent:
            sink.put_chunks({k: v for k, v in new.items() if k in absent})
            sent += sum(len(new[k]) for k in absent)
    if previous is not None and tuple(entries) == previous.entries:
        return previous  # nothing changed since the last upload
    manifest = Manifest(task_id=task_id, attempt=attempt, name=FILES_LABEL, created_at=now,
                        entries=tuple(entries), full=True,
                        size_bytes=sum(e.size for e in entries), new_bytes=sent,
                        metadata={"kind": FILES_LABEL})
    return sink.commit(manifest)


def _plan_file(name: str, path: Path, before: Entry | None,
               compressor: zstandard.ZstdCompressor) -> tuple[Entry, dict[str, bytes]]:
    """Read, never mapped: the step may truncate the file while it is read (`echo n >
    state`), and reading a mapping past a file's new end is SIGBUS — it killed the whole
    node-agent (found by the soak). A file rewritten meanwhile is read as it then is."""
    with path.open("rb") as file:
        mode = os.fstat(file.fileno()).st_mode & 0o777
        data = file.read()
    return plan_entry(name, "file", memoryview(data), before, delta=False,
                      compressor=compressor, mode=mode)


def _latest_files(sink: CheckpointSink, task_id: str) -> Manifest | None:
    found = [m for m in sink.list(task_id) if m.metadata.get("kind") == FILES_LABEL]
    return found[-1] if found else None


def restore(sink: CheckpointSink, task_id: str, root: Path) -> Manifest | None:
    """Write the latest uploaded files into an empty `root`; None if there are none."""
    manifest = _latest_files(sink, task_id)
    if manifest is None:
        return None
    root.mkdir(parents=True, exist_ok=True)
    for entry in manifest.entries:
        target = safe_target(root, entry.name)
        write_durably(target, read_entry(entry, sink.read_chunk))
        os.chmod(target, entry.mode or 0o644)
    return manifest


def safe_target(root: Path, name: str) -> Path:
    """Where an entry goes: under `root`, never outside it (no `..`, no absolute names)."""
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or any(p in {"..", ""} for p in parts):
        raise ValueError(f"checkpoint file name {name[:80]!r} would leave the directory")
    return root.joinpath(*parts)


def is_empty(root: Path) -> bool:
    return not root.is_dir() or not any(root.iterdir())
