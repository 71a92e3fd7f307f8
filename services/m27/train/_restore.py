"""Reading a checkpoint back: every chunk verified, decoded in parallel straight into the
bytes of its tensor."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import zstandard

from m27.common.checkpoint_format import (
    ChunkRef,
    CorruptChunk,
    Entry,
    Manifest,
    decode_chunk,
    sha256,
)
from m27.common.checkpoint_storage import CheckpointSink
from m27.train._errors import RestoreError
from m27.train._persist import FORMAT
from m27.train._state import dtype_from_name


def is_train_checkpoint(manifest: Manifest) -> bool:
    """Written by m27.train (not the node-agent's upload of a program's own files)."""
    return manifest.metadata.get("format") == FORMAT


def train_checkpoints(store: CheckpointSink, task_id: str) -> Iterator[Manifest]:
    """`task_id`'s checkpoints written by m27.train, the latest first (the node-agent's
    uploads of a program's own files skipped)."""
    latest = store.latest(task_id)
    if latest is None:
        return
    if is_train_checkpoint(latest):
        yield latest
    yield from (m for m in reversed(store.list(task_id))
                if is_train_checkpoint(m) and m.checkpoint_id != latest.checkpoint_id)


def read_checkpoint(store: CheckpointSink, manifest: Manifest, threads: int | None = None,
                    *, prefix: str = "", wanted: Callable[[str], bool] | None = None
                    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The skeleton of a checkpoint and its tensors (CPU, in the order the skeleton refers
    to them). A rank reads the skeleton in its `prefix`'s "meta" and "packed" ("rank1/")
    and only the other entries `wanted` names; a tensor of an entry not read comes back
    as a meta tensor (no data: loading it fails loudly)."""
    if not is_train_checkpoint(manifest):
        raise RestoreError(f"checkpoint {manifest.checkpoint_id} was not written by "
                           f"m27.train ({manifest.metadata.get('format') or 'no format'})")
    entries = {e.name: e for e in manifest.entries}
    meta, packed = f"{prefix}meta", f"{prefix}packed"
    for needed in (meta, packed):
        if needed not in entries:
            raise RestoreError(f"checkpoint {manifest.checkpoint_id} has no {needed!r} entry")
    chosen = [e for name, e in entries.items()
              if wanted is None or name in (meta, packed) or wanted(name)]
    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="m27-restore") as pool:
        data = read_entries(store, chosen, pool)
    skeleton = msgspec.json.decode(data[meta].numpy().tobytes())
    data["packed"] = data[packed]  # where _tensor finds the small tensors
    return skeleton, [_tensor(info, data) if info.get("entry", "packed") in data
                      else _not_read(info) for info in skeleton["tensors"]]


def _not_read(info: dict[str, Any]) -> torch.Tensor:
    return torch.empty(info["shape"], dtype=dtype_from_name(info["dtype"]), device="meta")


def read_entries(store: CheckpointSink, entries: list[Entry], pool: ThreadPoolExecutor
                 ) -> dict[str, torch.Tensor]:
    """Every entry's decoded bytes (uint8 tensors); chunks are read, verified and decoded
    concurrently (file reads, sha256, zstd and the XOR release the GIL). A raw chunk from
    a local directory is read straight into its place and hashed there: no copy."""
    out = {e.name: torch.empty(e.size, dtype=torch.uint8) for e in entries}
    jobs = []
    for entry in entries:
        view, offset = out[entry.name].numpy().data if entry.size else memoryview(b""), 0
        for ref in entry.chunks:
            jobs.append(pool.submit(_decode_into, ref, store, view[offset:offset + ref.length]))
            offset += ref.length
        if offset != entry.size:
            raise RestoreError(f"entry {entry.name}: chunks hold {offset} bytes, "
                               f"not {entry.size}")
    for job in jobs:
        job.result()
    return out


def _decode_into(ref: ChunkRef, store: CheckpointSink, target: memoryview) -> None:
    read_into = getattr(store, "read_chunk_into", None)
    if ref.codec == "raw" and read_into is not None:
        read_into(ref.id, target)
        if ref.raw_sha256 != ref.id or sha256(target) != ref.id:
            raise CorruptChunk(f"chunk {ref.id[:12]} does not match its hash")
        return
    target[:] = decode_chunk(ref, store.read_chunk, zstandard.ZstdDecompressor())


def _tensor(info: dict[str, Any], data: dict[str, torch.Tensor]) -> torch.Tensor:
    dtype = dtype_from_name(info["dtype"])
    if "entry" in info:
        raw, offset, nbytes = data[info["entry"]], 0, data[info["entry"]].numel()
    else:
        raw = data["packed"]
        offset, nbytes = info["packed"]
    if nbytes == 0:
        return torch.empty(info["shape"], dtype=dtype)
    flat = raw[offset:offset + nbytes]
    if "entry" not in info:  # a small tensor of the packed entry gets storage of its own:
        flat = flat.clone()  # some readers (torch.set_rng_state) ignore a storage offset
    return flat.view(dtype).reshape(info["shape"])
