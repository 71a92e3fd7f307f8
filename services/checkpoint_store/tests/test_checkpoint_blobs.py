"""The plain-file blob store: atomic, durable writes and paths that never escape the root."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from m27.checkpoint_store._blobs import TEMP_DIR, BlobDigest, FileBlobStore
from m27.checkpoint_store._errors import BlobMissing, CheckpointCorrupt, StorageError
from m27.checkpoint_store._ids import CheckpointRef

RUN = "r-20240101-120000-abc123"
REF = CheckpointRef(RUN, "train", "c-1704110400000-0a1b2c")


@pytest.fixture
def store(tmp_path: Path) -> FileBlobStore:
    blobs = FileBlobStore(tmp_path / "root")
    blobs.recover()
    return blobs


def blob_path(root: Path, ref: CheckpointRef) -> Path:
    return root.joinpath(*ref.blob_parts)


def temp_files(root: Path) -> list[str]:
    return sorted(os.listdir(root / TEMP_DIR))


def test_a_blob_appears_only_on_commit(store: FileBlobStore) -> None:
    """Until commit the bytes live in a temp file; afterwards only at the final path."""
    writer = store.create()
    writer.write(b"hello ")
    writer.write(bytearray(b"world"))
    assert not blob_path(store.root, REF).exists()
    assert len(temp_files(store.root)) == 1
    digest = writer.commit(REF)
    assert digest == BlobDigest(11, hashlib.sha256(b"hello world").hexdigest())
    assert blob_path(store.root, REF).read_bytes() == b"hello world"
    assert temp_files(store.root) == []
    writer.abort()  # after commit: a no-op, the blob stays
    assert blob_path(store.root, REF).exists()


def test_abort_leaves_nothing(store: FileBlobStore) -> None:
    writer = store.create()
    writer.write(b"partial")
    writer.abort()
    writer.abort()
    assert temp_files(store.root) == []
    assert not (store.root / RUN).exists()


def test_recover_removes_temp_leftovers_only(store: FileBlobStore) -> None:
    """What a crashed Put left in the temp dir goes; committed blobs stay."""
    committed = store.create()
    committed.write(b"keep")
    committed.commit(REF)
    for _ in range(3):
        store.create().write(b"crashed mid-write")  # never committed nor aborted
    assert len(temp_files(store.root)) == 3
    assert store.recover() == 3
    assert temp_files(store.root) == []
    assert blob_path(store.root, REF).read_bytes() == b"keep"
    assert store.recover() == 0


def test_recover_creates_the_root(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path / "a" / "b")
    assert store.recover() == 0
    assert (tmp_path / "a" / "b" / TEMP_DIR).is_dir()


def test_read_back_and_delete(store: FileBlobStore) -> None:
    writer = store.create()
    writer.write(b"x" * 5000)
    writer.commit(REF)
    reader = store.open(REF)
    assert reader.size == 5000
    assert reader.read(4096) == b"x" * 4096
    assert reader.read(4096) == b"x" * 904
    assert reader.read(4096) == b""
    reader.close()
    assert store.delete(REF) is True
    assert store.delete(REF) is False
    with pytest.raises(BlobMissing):
        store.open(REF)


def test_missing_task_directories_mean_missing_blob(store: FileBlobStore) -> None:
    with pytest.raises(BlobMissing):
        store.open(CheckpointRef(RUN, "never-written", REF.checkpoint_id))
    assert store.delete(CheckpointRef(RUN, "never-written", REF.checkpoint_id)) is False


def test_a_symlinked_blob_is_not_followed(store: FileBlobStore, tmp_path: Path) -> None:
    """A symlink planted where a blob belongs is refused, not read through."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    path = blob_path(store.root, REF)
    path.parent.mkdir(parents=True)
    path.symlink_to(secret)
    with pytest.raises(CheckpointCorrupt, match="not a plain file"):
        store.open(REF)


def test_a_symlinked_task_directory_is_not_followed(store: FileBlobStore,
                                                    tmp_path: Path) -> None:
    outside = tmp_path / "outside" / "train"
    outside.mkdir(parents=True)
    (outside / f"{REF.checkpoint_id}.blob").write_bytes(b"not yours")
    (store.root / RUN).symlink_to(outside.parent)
    with pytest.raises(CheckpointCorrupt, match="not a plain file"):
        store.open(REF)
    writer = store.create()
    writer.write(b"mine")
    with pytest.raises(StorageError, match="cannot store"):
        writer.commit(REF)
    assert (outside / f"{REF.checkpoint_id}.blob").read_bytes() == b"not yours"


def test_a_fifo_in_place_of_a_blob_fails_fast(store: FileBlobStore) -> None:
    """Opening must not hang on a FIFO waiting for a writer."""
    path = blob_path(store.root, REF)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with pytest.raises(CheckpointCorrupt, match="not a plain file"):
        store.open(REF)
