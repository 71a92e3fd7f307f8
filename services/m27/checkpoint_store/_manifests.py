"""Manifests as the store keeps them: validation of a committed one, and its summary (pure).

A client commits JSON of `checkpoint_format.Manifest`; nothing in it is trusted. It must
name the task and attempt of the request, every chunk id must be a sha256, sizes must add
up, entry names must be relative paths that stay inside a directory, and the whole must fit
comfortably in one KV value. The store then fills in what it knows better than the client
(`checkpoint_id`, `created_at`, `size_bytes`, `new_bytes`, `full`, `seq`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

import msgspec

from m27.checkpoint_store._ids import shown
from m27.common.checkpoint_api import CheckpointTooLarge, InvalidCheckpointRequest
from m27.common.checkpoint_format import ChunkRef, Entry, Manifest, chunk_ids, is_chunk_id

#: The KV bucket holds values up to 4 MiB; the store adds a few fields to what it gets.
MAX_MANIFEST_BYTES: Final = 3 * 1024 * 1024
MAX_NAME_CHARS: Final = 200
MAX_ENTRY_NAME_CHARS: Final = 1024
MAX_METADATA_ENTRIES: Final = 64
MAX_METADATA_BYTES: Final = 64 * 1024
MAX_CURSOR_ENTRIES: Final = 256
#: A chunk's stored bytes travel in one gRPC message (16 MiB at most).
MAX_STORED_CHUNK_BYTES: Final = 15 * 1024 * 1024
MAX_CHUNK_BYTES: Final = 64 * 1024 * 1024
MAX_DELTA_DEPTH: Final = 64
MAX_DIMS: Final = 32
INT64_MAX: Final = 2**63 - 1

_DECODER: Final = msgspec.json.Decoder(Manifest)


def decode_manifest(data: bytes | str, *, task_id: str, attempt: int,
                    max_bytes: int) -> Manifest:
    """The manifest a Commit carries, checked; InvalidCheckpointRequest naming the first
    problem, CheckpointTooLarge past the limits."""
    size = len(data.encode() if isinstance(data, str) else data)
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointTooLarge(
            f"a manifest may be at most {MAX_MANIFEST_BYTES} bytes of JSON, got {size}")
    try:
        manifest = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise InvalidCheckpointRequest(f"manifest_json is not a manifest: {exc}") from None
    if manifest.task_id != task_id:
        raise InvalidCheckpointRequest(
            f"the manifest is of task {shown(manifest.task_id)}, the request of {task_id}")
    if manifest.attempt != attempt:
        raise InvalidCheckpointRequest(
            f"the manifest is of attempt {manifest.attempt}, the request of {attempt}")
    if manifest.checkpoint_id:
        raise InvalidCheckpointRequest("checkpoint_id is assigned by the store: send it empty")
    check_labels(manifest)
    check_entries(manifest.entries)
    total = sum(entry.size for entry in manifest.entries)
    if total > max_bytes:
        raise CheckpointTooLarge(
            f"a checkpoint may be at most {max_bytes} bytes; this one holds {total}")
    return manifest


def check_labels(manifest: Manifest) -> None:
    if len(manifest.name) > MAX_NAME_CHARS:
        raise InvalidCheckpointRequest(
            f"name must be at most {MAX_NAME_CHARS} characters, got {len(manifest.name)}")
    for field, value in (("step", manifest.step), ("epoch", manifest.epoch),
                         ("chain", manifest.chain)):
        if value is not None and not 0 <= value <= INT64_MAX:
            raise InvalidCheckpointRequest(f"{field} must be 0 or more, got {value}")
    if not math.isfinite(manifest.created_at):
        raise InvalidCheckpointRequest("created_at must be a finite number")
    check_mapping("metadata", manifest.metadata, MAX_METADATA_ENTRIES)
    check_mapping("cursor", manifest.cursor, MAX_CURSOR_ENTRIES)


def check_mapping(field: str, values: Mapping[str, object], max_entries: int) -> None:
    """Bounded, so a manifest always fits comfortably in one KV value."""
    if len(values) > max_entries:
        raise InvalidCheckpointRequest(
            f"{field} may have at most {max_entries} entries, got {len(values)}")
    if any(not key for key in values):
        raise InvalidCheckpointRequest(f"{field} keys must not be empty")
    total = sum(len(k.encode()) + len(str(v).encode()) for k, v in values.items())
    if total > MAX_METADATA_BYTES:
        raise InvalidCheckpointRequest(
            f"{field} may hold at most {MAX_METADATA_BYTES} bytes of keys and values, "
            f"got {total}")


def check_entries(entries: Iterable[Entry]) -> None:
    seen: set[str] = set()
    for entry in entries:
        check_entry_name(entry.name)
        if entry.name in seen:
            raise InvalidCheckpointRequest(f"two entries are named {shown(entry.name)}")
        seen.add(entry.name)
        check_entry(entry)


def check_entry_name(name: str) -> None:
    """A relative path that stays inside the directory it is restored into."""
    problem = entry_name_problem(name)
    if problem:
        raise InvalidCheckpointRequest(f"entry name {shown(name)} {problem}")


def entry_name_problem(name: str) -> str:
    """Why `name` cannot be an entry's name, or "" when it can."""
    if not name or len(name) > MAX_ENTRY_NAME_CHARS:
        return f"must have 1 to {MAX_ENTRY_NAME_CHARS} characters"
    if any(ord(c) < 32 or ord(c) == 127 or c == "\\" for c in name):
        return "must not contain control characters or backslashes"
    if name.startswith("/") or any(p in {"", ".", ".."} for p in name.split("/")):
        return "must be a relative path without empty, `.` or `..` parts"
    return ""


def check_entry(entry: Entry) -> None:
    where = f"entry {shown(entry.name)}"
    if entry.size < 0 or sum(ref.length for ref in entry.chunks) != entry.size:
        raise InvalidCheckpointRequest(f"{where}: its chunks do not add up to its size")
    if len(entry.dtype) > 32 or len(entry.shape) > MAX_DIMS or any(d < 0 for d in entry.shape):
        raise InvalidCheckpointRequest(f"{where}: bad dtype or shape")
    if not 0 <= entry.mode <= 0o7777:
        raise InvalidCheckpointRequest(f"{where}: mode must be between 0 and 0o7777")
    for ref in entry.chunks:
        check_ref(ref, where)


def check_ref(ref: ChunkRef, where: str) -> None:
    """One chunk ref and its delta bases, walked without recursion."""
    node: ChunkRef | None = ref
    depth = 0
    while node is not None:
        if not is_chunk_id(node.id) or not is_chunk_id(node.raw_sha256):
            raise InvalidCheckpointRequest(
                f"{where}: chunk id {shown(node.id)} is not a sha256 (64 lower-case hex)")
        if not 0 <= node.length <= MAX_CHUNK_BYTES or \
                not 0 <= node.stored <= MAX_STORED_CHUNK_BYTES:
            raise InvalidCheckpointRequest(f"{where}: chunk {node.id[:12]} has a bad size")
        if (node.codec == "xor-zstd") != (node.base is not None):
            raise InvalidCheckpointRequest(
                f"{where}: chunk {node.id[:12]}: an xor-zstd chunk needs a base, a zstd "
                "chunk has none")
        if node.codec == "raw" and (node.id != node.raw_sha256 or node.stored != node.length):
            raise InvalidCheckpointRequest(
                f"{where}: chunk {node.id[:12]}: a raw chunk is stored as it is (its id is "
                "its raw_sha256, its stored size its length)")
        if node.base is not None and node.base.length != node.length:
            raise InvalidCheckpointRequest(
                f"{where}: chunk {node.id[:12]} and its base differ in length")
        depth += 1
        if depth > MAX_DELTA_DEPTH + 1:
            raise InvalidCheckpointRequest(
                f"{where}: a delta chain longer than {MAX_DELTA_DEPTH}")
        node = node.base


def stored_sizes(manifest: Manifest) -> dict[str, int]:
    """Every chunk the manifest needs (delta bases included) → its stored size."""
    sizes: dict[str, int] = {}
    for ref in _refs(manifest):
        sizes.setdefault(ref.id, ref.stored)
    return sizes


def _refs(manifest: Manifest) -> Iterator[ChunkRef]:
    for entry in manifest.entries:
        for ref in entry.chunks:
            node: ChunkRef | None = ref
            while node is not None:
                yield node
                node = node.base


def seal(manifest: Manifest, *, checkpoint_id: str, now: float, seq: int,
         previous: Manifest | None) -> Manifest:
    """The manifest as committed: the store's id, time and order, and sizes it computed
    (`new_bytes`: stored bytes of chunks the task's previous checkpoint did not use)."""
    before = chunk_ids(previous) if previous is not None else set()
    sizes = stored_sizes(manifest)
    fields = msgspec.structs.asdict(manifest)
    fields.update(
        checkpoint_id=checkpoint_id, created_at=now, seq=seq, protected="",
        size_bytes=sum(entry.size for entry in manifest.entries),
        new_bytes=sum(size for chunk, size in sizes.items() if chunk not in before),
        full=all(ref.base is None for entry in manifest.entries for ref in entry.chunks))
    return Manifest(**fields)
