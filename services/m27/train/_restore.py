"""Reading a checkpoint back: every chunk verified, decoded in parallel straight into the
bytes of its tensor."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import zstandard

from m27.common.checkpoint_format import Entry, Manifest, decode_chunk
from m27.common.checkpoint_storage import CheckpointSink
from m27.train._errors import RestoreError
from m27.train._persist import FORMAT
from m27.train._state import dtype_from_name


def is_train_checkpoint(manifest: Manifest) -> bool:
    """Written by m27.train (not the node-agent's upload of a program's own files)."""
    return manifest.metadata.get("format") == FORMAT


def read_checkpoint(store: CheckpointSink, manifest: Manifest, threads: int | None = None
                    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The skeleton of a checkpoint and its tensors (CPU, in the order the skeleton refers
    to them)."""
    if not is_train_checkpoint(manifest):
        raise RestoreError(f"checkpoint {manifest.checkpoint_id} was not written by "
                           f"m27.train ({manifest.metadata.get('format') or 'no format'})")
    entries = {e.name: e for e in manifest.entries}
    for needed in ("meta", "packed"):
        if needed not in entries:
            raise RestoreError(f"checkpoint {manifest.checkpoint_id} has no {needed!r} entry")
    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="m27-restore") as pool:
        data = read_entries(store, list(entries.values()), pool)
    skeleton = msgspec.json.decode(bytes(data["meta"]))
    return skeleton, [_tensor(info, data) for info in skeleton["tensors"]]


def read_entries(store: CheckpointSink, entries: list[Entry], pool: ThreadPoolExecutor
                 ) -> dict[str, bytearray]:
    """Every entry's decoded bytes; chunks are decoded concurrently (zstd, sha256 and the
    XOR release the GIL)."""
    out = {e.name: bytearray(e.size) for e in entries}
    jobs = []
    for entry in entries:
        view, offset = memoryview(out[entry.name]), 0
        for ref in entry.chunks:
            jobs.append(pool.submit(_decode_into, ref, store, view[offset:offset + ref.length]))
            offset += ref.length
        if offset != entry.size:
            raise RestoreError(f"entry {entry.name}: chunks hold {offset} bytes, "
                               f"not {entry.size}")
    for job in jobs:
        job.result()
    return out


def _decode_into(ref: Any, store: CheckpointSink, target: memoryview) -> None:
    target[:] = decode_chunk(ref, store.read_chunk, zstandard.ZstdDecompressor())


def _tensor(info: dict[str, Any], data: dict[str, bytearray]) -> torch.Tensor:
    dtype = dtype_from_name(info["dtype"])
    if "entry" in info:
        raw, offset, nbytes = data[info["entry"]], 0, len(data[info["entry"]])
    else:
        raw = data["packed"]
        offset, nbytes = info["packed"]
    if nbytes == 0:
        return torch.empty(info["shape"], dtype=dtype)
    flat = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).reshape(info["shape"])
