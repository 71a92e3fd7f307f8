"""The chunk directory as the store serves it: verified, durable, and never fooled by what
someone planted in it (symlinks, FIFOs, damaged files)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from m27.checkpoint_store._chunks import PREFIXES, QUARANTINE_DIR, ChunkStore
from m27.common.checkpoint_api import CheckpointCorrupt, ChunkMissing, StorageError
from m27.common.checkpoint_storage import TMP_PREFIX


def cid(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def store(tmp_path: Path) -> ChunkStore:
    chunks = ChunkStore(tmp_path / "root")
    chunks.prepare()
    return chunks


def test_prepare_makes_every_prefix_directory(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "a" / "b")
    assert store.prepare() == 0
    assert sorted(p.name for p in (tmp_path / "a" / "b" / "chunks").iterdir()) == \
        list(PREFIXES)
    assert (tmp_path / "a" / "b" / QUARANTINE_DIR).is_dir()
    assert store.prepare() == 0  # a second start changes nothing


def test_a_chunk_is_stored_once_under_its_hash(store: ChunkStore) -> None:
    data = b"some chunk bytes"
    assert store.put(cid(data), data) is True
    assert store.put(cid(data), data) is False
    path = store.root / "chunks" / cid(data)[:2] / cid(data)
    assert path.read_bytes() == data
    assert store.read(cid(data)) == data
    assert [c.id for c in store.files()] == [cid(data)]
    assert [c.size for c in store.files()] == [len(data)]


def test_bytes_that_do_not_match_their_id_are_refused(store: ChunkStore) -> None:
    with pytest.raises(CheckpointCorrupt, match="does not match its bytes"):
        store.put(cid(b"one"), b"two")
    assert list(store.files()) == []


def test_missing_reports_absent_chunks_and_touches_present_ones(store: ChunkStore) -> None:
    data = b"present"
    store.put(cid(data), data)
    path = store.dir.path(cid(data))
    os.utime(path, (1000, 1000))
    assert store.missing([cid(data), cid(b"absent")]) == [cid(b"absent")]
    assert path.stat().st_mtime > time.time() - 60  # protected from GC for its grace


def test_problems_are_missing_wrong_size_or_not_a_file(store: ChunkStore,
                                                       tmp_path: Path) -> None:
    good, short, link = b"good", b"shortened", b"linked"
    for data in (good, short):
        store.put(cid(data), data)
    store.dir.path(cid(short)).write_bytes(b"short")
    store.dir.path(cid(link)).symlink_to(tmp_path)
    sizes = {cid(good): 4, cid(short): 9, cid(link): 6, cid(b"never"): 5}
    assert store.problems(sizes) == {
        cid(short): "5 bytes on disk, 9 expected",
        cid(link): "not a plain file",
        cid(b"never"): "missing",
    }


def test_a_damaged_chunk_is_quarantined_on_read(store: ChunkStore) -> None:
    """Corruption found by reading moves the file aside: from then on it reads as missing,
    and uploading the same bytes again repairs it."""
    data = os.urandom(5000)
    store.put(cid(data), data)
    path = store.dir.path(cid(data))
    damaged = bytearray(data)
    damaged[100] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointCorrupt, match=f"chunk {cid(data)} is corrupt on disk"):
        store.read(cid(data))
    assert not path.exists()
    assert [p.read_bytes() for p in store.quarantine_dir.iterdir()] == [bytes(damaged)]
    with pytest.raises(ChunkMissing, match="is not in the store"):
        store.read(cid(data))
    assert store.missing([cid(data)]) == [cid(data)]
    assert store.put(cid(data), data) is True
    assert store.read(cid(data)) == data


def test_a_symlinked_chunk_is_not_followed(store: ChunkStore, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    store.dir.path(cid(b"not yours")).symlink_to(secret)
    with pytest.raises(CheckpointCorrupt, match="not a plain file"):
        store.read(cid(b"not yours"))
    assert store.missing([cid(b"not yours")]) == [cid(b"not yours")]


def test_a_fifo_in_place_of_a_chunk_fails_fast(store: ChunkStore) -> None:
    """Opening must not hang waiting for a writer."""
    os.mkfifo(store.dir.path(cid(b"x")))
    with pytest.raises(CheckpointCorrupt, match="not a plain file"):
        store.read(cid(b"x"))


def test_a_symlinked_prefix_directory_stops_the_store(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ChunkStore(root).prepare()
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "chunks" / "ab").rmdir()
    (root / "chunks" / "ab").symlink_to(outside)
    with pytest.raises(StorageError, match="not a directory"):
        ChunkStore(root).prepare()


def test_leftover_temp_files_go_once_old_enough(store: ChunkStore) -> None:
    folder = store.dir.root / "ab"
    old, fresh = folder / f"{TMP_PREFIX}x.1", folder / f"{TMP_PREFIX}y.2"
    for path in (old, fresh):
        path.write_bytes(b"crashed mid-write")
    os.utime(old, (1000, 1000))
    assert store.prepare(temp_older_than_s=3600) == 1
    assert not old.exists()
    assert fresh.exists()
    assert list(store.files()) == []  # temp files are never chunks


def test_delete_if_older_spares_a_chunk_touched_since_listing(store: ChunkStore) -> None:
    data = b"racy"
    store.put(cid(data), data)
    os.utime(store.dir.path(cid(data)), (1000, 1000))
    assert store.delete_if_older(cid(data), cutoff=500) is False
    assert store.delete_if_older(cid(data), cutoff=2000) is True
    assert store.delete_if_older(cid(data), cutoff=2000) is False
    store.sync_prefixes({cid(data)[:2]})
