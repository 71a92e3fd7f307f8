"""Reusing the results of identical earlier steps, like Nextflow's `-resume`.

A step's cache key is the hash of what determines its results: its resolved command, type,
resources, environment, working directory, declared outputs, the *content* of its declared
inputs and of the outputs of the steps it depends on. Only steps that declare outputs are
reused — those are what a later step consumes, and they are checked (same content as
recorded) before a hit counts; a step that declares none always runs. List the scripts a
step runs under `inputs:` so that editing them invalidates the cache. Reuse needs the run's
working directory (so outputs are where the pipeline expects them) and, for hashing, the
orchestrator must see the files (true on one machine and on a shared filesystem);
otherwise the step simply runs.

`cache_key` and `verdict` are pure; `Cache` does the file hashing (in a thread) and keeps
entries in the KV bucket `m27_cache`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import msgspec

from m27.common import subjects
from m27.common.bus import Bus
from m27.common.errors import M27Error
from m27.common.logging import get_logger
from m27.common.model import RunRecord, StepRecord
from m27.orchestrator.runs import CacheHit, absolute, step_workdir

log = get_logger()

CHUNK: Final = 1024 * 1024
MAX_TREE_FILES: Final = 100_000
#: What one input or output may take to hash (all its files together): more, and the step
#: is simply not cached. A device (`/dev/zero`) or a FIFO is never read at all.
MAX_HASH_BYTES: Final = 64 * 1024**3
MAX_HASH_S: Final = 300.0


class OutputRecord(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    digest: str


class CacheEntry(msgspec.Struct, frozen=True, kw_only=True):
    """What an earlier step produced, kept under its cache key."""

    task_id: str
    outputs: tuple[OutputRecord, ...]
    created_at: float


class NotCacheable(M27Error):
    """Why a step cannot be reused (it then runs); shown in the plan."""


def cacheable(run: RunRecord, step: StepRecord) -> str:
    """'' when the step may be reused, else why not."""
    if not run.use_cache:
        return "caching is off for this run (--no-cache)"
    if not step.outputs:
        return "declares no outputs"
    if not step_workdir(run, step) or not os.path.isabs(step_workdir(run, step)):
        return "the run has no working directory to find earlier outputs in"
    return ""


def cache_key(run: RunRecord, step: StepRecord, input_digests: Mapping[str, str]) -> str:
    """The hash of everything that determines the step's results (pure). Secret values
    are not in it (m27 never keeps them past the run), only their names."""
    material: dict[str, object] = {
        "command": step.command, "type": step.type,
        "resources": msgspec.to_builtins(step.resources), "env": dict(sorted(step.env.items())),
        "workdir": step_workdir(run, step),
        "outputs": [absolute(run, step, o) for o in step.outputs],
        "inputs": sorted(input_digests.items()),
    }
    if step.secret_env:
        material["secret_env"] = sorted(step.secret_env)
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def verdict(entry: CacheEntry | None, current: Mapping[str, str | None]) -> CacheHit | None:
    """A hit when an entry exists and every output it recorded is still there, unchanged."""
    if entry is None or not entry.outputs:
        return None
    if any(current.get(o.path) != o.digest for o in entry.outputs):
        return None
    return CacheHit(task_id=entry.task_id, outputs=tuple(o.path for o in entry.outputs))


class _Budget:
    """Bytes and seconds one digest may still take; OSError once either is spent."""

    def __init__(self, path: str, max_bytes: int, max_s: float) -> None:
        self.path, self.left, self.deadline = path, max_bytes, time.monotonic() + max_s

    def spend(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise OSError(f"{self.path}: more than {_gib(MAX_HASH_BYTES)} to hash")
        if time.monotonic() > self.deadline:
            raise OSError(f"{self.path}: hashing took more than {MAX_HASH_S:.0f}s")


def _gib(size: int) -> str:
    return f"{size / 1024**3:g} GiB"


def digest_path(path: str, *, max_bytes: int = MAX_HASH_BYTES,
                max_s: float = MAX_HASH_S) -> str:
    """sha256 of a regular file's bytes, or of a directory's regular files (relative names
    and contents), within a budget of bytes and time.

    Raises OSError when it cannot be read, is something else (a device, a FIFO, a socket:
    reading `/dev/zero` would never end), or is over the budget."""
    target = Path(path)
    budget = _Budget(path, max_bytes, max_s)
    mode = target.stat().st_mode
    if stat.S_ISDIR(mode):
        tree = hashlib.sha256(b"dir\0")
        files = sorted(p for p in target.rglob("*") if p.is_file())
        if len(files) > MAX_TREE_FILES:
            raise OSError(f"{path}: more than {MAX_TREE_FILES} files to hash")
        for file in files:
            tree.update(str(file.relative_to(target)).encode() + b"\0")
            tree.update(_file_digest(file, budget).encode())
        return tree.hexdigest()
    if not stat.S_ISREG(mode):
        raise OSError(f"{path}: not a regular file or directory")
    return _file_digest(target, budget)


def _file_digest(path: Path, budget: _Budget) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):  # swapped after the check
            raise OSError(f"{path}: not a regular file")
        while chunk := file.read(CHUNK):
            budget.spend(len(chunk))
            digest.update(chunk)
    return digest.hexdigest()


class _Digests:
    """Digests remembered by (path, size, mtime, inode): unchanged files are hashed once."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int, int, int], str] = {}

    def of(self, path: str) -> str:
        stat = os.stat(path)
        key = (path, stat.st_size, stat.st_mtime_ns, stat.st_ino)
        if key not in self._known:
            self._known[key] = digest_path(path)
        return self._known[key]

    def of_all(self, paths: list[str]) -> dict[str, str | None]:
        result: dict[str, str | None] = {}
        for path in paths:
            try:
                result[path] = self.of(path)
            except OSError:
                result[path] = None
        return result


class Cache:
    """Lookup and store of cache entries; file hashing runs in a worker thread."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._digests = _Digests()

    async def lookup(self, run: RunRecord, step: StepRecord) -> tuple[str, CacheHit | None]:
        """(cache key, hit or None); key '' when the step cannot be reused."""
        try:
            key = await asyncio.to_thread(self._key, run, step)
        except NotCacheable as exc:
            log.info("cache.not_cacheable", step=step.name, reason=str(exc))
            return "", None
        got = await self.bus.kv_get(subjects.CACHE_BUCKET, key, CacheEntry)
        entry = got[0] if got else None
        outputs = [o.path for o in entry.outputs] if entry else []
        current = await asyncio.to_thread(self._digests.of_all, outputs)
        hit = verdict(entry, current)
        log.info("cache.lookup", step=step.name, key=key[:12], hit=bool(hit))
        return key, hit

    def _key(self, run: RunRecord, step: StepRecord) -> str:
        why = cacheable(run, step)
        if why:
            raise NotCacheable(why)
        digests: dict[str, str] = {}
        for path in (absolute(run, step, i) for i in step.inputs):
            digests[path] = self._readable(path, "input")
        for name in step.depends_on:
            digests.update(self._upstream(run, name))
        return cache_key(run, step, digests)

    def _readable(self, path: str, what: str) -> str:
        try:
            return self._digests.of(path)
        except OSError as exc:
            raise NotCacheable(f"{what} {path} cannot be hashed: "
                               f"{exc.strerror or exc}") from exc

    def _upstream(self, run: RunRecord, name: str) -> dict[str, str]:
        """What a dependency contributes to the key: the content of its outputs (a step
        reads what the steps before it made), else who ran it — so a step after one that
        ran again without declaring outputs is never mistaken for an earlier one."""
        dep = run.step(name)
        if dep is None:
            return {}
        if dep.outputs:
            return {f"after {name}: {p}": self._readable(p, f"{name}'s output")
                    for p in (absolute(run, dep, o) for o in dep.outputs)}
        who = dep.cache_key if dep.cached_from else f"{run.run_id}/{name}#{dep.attempt}"
        return {f"after {name}": who}

    async def store(self, run: RunRecord, step: StepRecord, now: float) -> None:
        """Remember a step that succeeded by running, if it is reusable."""
        if not step.cache_key or step.cached_from:
            return
        paths = [absolute(run, step, o) for o in step.outputs]
        current = await asyncio.to_thread(self._digests.of_all, paths)
        if any(d is None for d in current.values()):
            return  # an output vanished already; nothing trustworthy to keep
        entry = CacheEntry(task_id=f"{run.run_id}/{step.name}", created_at=now,
                           outputs=tuple(OutputRecord(path=p, digest=d or "")
                                         for p, d in current.items()))
        await self.bus.kv_put(subjects.CACHE_BUCKET, step.cache_key, entry)
        log.info("cache.stored", step=step.name, key=step.cache_key[:12])
