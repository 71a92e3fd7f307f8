"""The checkpoint format: chunks, deltas, dedupe, verification."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import zstandard

from m27.common.checkpoint_format import (
    CorruptChunk,
    chain_depth,
    chunk_ids,
    plan_entry,
    read_entry,
    sha256,
)

ZSTD = zstandard.ZstdCompressor(level=3)


def floats(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_an_entry_round_trips_through_its_chunks() -> None:
    data = floats(300_000)
    entry, new = plan_entry("w", "tensor", memoryview(data.tobytes()), None, delta=False,
                            compressor=ZSTD, chunk_bytes=256 * 1024)
    assert len(entry.chunks) == 5
    assert all(c.codec == "zstd" for c in entry.chunks)
    assert read_entry(entry, new.__getitem__) == data.tobytes()


def test_unchanged_chunks_are_not_stored_again() -> None:
    data = floats(300_000)
    first, stored = plan_entry("w", "tensor", memoryview(data.tobytes()), None, delta=False,
                               compressor=ZSTD, chunk_bytes=256 * 1024)
    changed = data.copy()
    changed[-10:] += 1.0  # only the last chunk changes
    second, new = plan_entry("w", "tensor", memoryview(changed.tobytes()), first, delta=False,
                             compressor=ZSTD, chunk_bytes=256 * 1024)
    assert second.chunks[:-1] == first.chunks[:-1]
    assert len(new) == 1
    assert read_entry(second, {**stored, **new}.__getitem__) == changed.tobytes()


def test_a_small_update_stored_as_an_xor_delta_is_much_smaller() -> None:
    data = floats(262_144)
    raw = data.tobytes()
    first, stored = plan_entry("w", "tensor", memoryview(raw), None, delta=False,
                               compressor=ZSTD)
    updated = data - np.float32(1e-4) * floats(262_144, seed=1)  # one small optimizer step
    second, new = plan_entry("w", "tensor", memoryview(updated.tobytes()), first, delta=True,
                             compressor=ZSTD, previous_raw=lambda i: raw)
    (chunk,) = second.chunks
    assert chunk.codec == "xor-zstd"
    assert chain_depth(chunk) == 1
    plain, _ = plan_entry("w", "tensor", memoryview(updated.tobytes()), None, delta=False,
                          compressor=ZSTD)
    assert chunk.stored < 0.8 * plain.chunks[0].stored
    everything = {**stored, **new}
    assert read_entry(second, everything.__getitem__) == updated.tobytes()
    assert chunk_ids_of(second) == set(everything)


def chunk_ids_of(entry: object) -> set[str]:
    from m27.common.checkpoint_format import Manifest

    return chunk_ids(Manifest(task_id="t", entries=(entry,)))  # type: ignore[arg-type]


def test_random_changes_fall_back_to_plain_zstd() -> None:
    first, _ = plan_entry("w", "tensor", memoryview(floats(65536).tobytes()), None,
                          delta=False, compressor=ZSTD)
    other = floats(65536, seed=9).tobytes()
    second, _ = plan_entry("w", "tensor", memoryview(other), first, delta=True,
                           compressor=ZSTD, previous_raw=lambda i: floats(65536).tobytes())
    assert second.chunks[0].codec == "zstd"


def test_corruption_is_detected_on_read() -> None:
    entry, stored = plan_entry("w", "bytes", memoryview(b"x" * 1000), None, delta=False,
                               compressor=ZSTD)
    (chunk_id,) = stored
    flipped = bytearray(stored[chunk_id])
    flipped[-1] ^= 1
    with pytest.raises(CorruptChunk, match="does not match its hash"):
        read_entry(entry, {chunk_id: bytes(flipped)}.__getitem__)


def test_an_empty_entry_has_one_empty_chunk() -> None:
    entry, stored = plan_entry("e", "bytes", memoryview(b""), None, delta=False,
                               compressor=ZSTD)
    assert entry.size == 0
    assert read_entry(entry, stored.__getitem__) == b""


def test_a_local_store_commits_only_complete_checkpoints(tmp_path: object) -> None:
    from pathlib import Path

    from m27.common.checkpoint_format import Manifest
    from m27.common.checkpoint_storage import LocalStore

    root = Path(str(tmp_path))
    store = LocalStore(root)
    entry, new = plan_entry("w", "tensor", memoryview(floats(1000).tobytes()), None,
                            delta=False, compressor=ZSTD)
    manifest = Manifest(task_id="r-20261201-000000-abcdef/train", entries=(entry,))
    with pytest.raises(ValueError, match="not stored"):
        store.commit(manifest)
    assert store.missing(list(new)) == set(new)
    store.put_chunks(new)
    committed = store.commit(manifest)
    assert committed.checkpoint_id.startswith("c-")
    latest = store.latest("r-20261201-000000-abcdef/train")
    assert latest == committed
    assert read_entry(latest.entries[0], store.read_chunk) == floats(1000).tobytes()
    (chunk_id,) = new
    path = store.chunks.path(chunk_id)
    path.write_bytes(b"garbage")
    with pytest.raises(CorruptChunk):  # read_chunk leaves the hash to its reader
        read_entry(latest.entries[0], store.read_chunk)
    with pytest.raises(ValueError, match="not a task id"):
        store.list("../../etc")


def test_a_chunk_directory_ignores_symlinks_and_fifos_in_place_of_chunks(tmp_path: Path) -> None:
    from m27.common.checkpoint_storage import ChunkDir

    chunks = ChunkDir(tmp_path)
    data = b"real bytes"
    chunk_id = sha256(data)
    target = chunks.path(chunk_id)
    target.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(data)
    target.symlink_to(elsewhere)
    assert not chunks.has(chunk_id)
    with pytest.raises(OSError, match=r"symbolic links|Too many levels"):
        chunks.get(chunk_id)
    target.unlink()
    os.mkfifo(target)
    assert not chunks.has(chunk_id)
    with pytest.raises(CorruptChunk, match="not a regular file"):
        chunks.get(chunk_id)
    target.unlink()
    assert chunks.put(chunk_id, data)
    assert chunks.get(chunk_id) == data
