"""Resumable HDF5 shards: written durably shard by shard, read by (epoch, batch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from m27.train import Cursor, ResumableSampler

hdf5 = pytest.importorskip("m27.train.hdf5")

FIELDS = {"x": ((4,), "float32"), "y": ((), "int64")}


def samples(start: int, stop: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, stop)
    return {"x": np.repeat(ids[:, None], 4, axis=1).astype(np.float32), "y": ids}


def write(directory: Path, total: int = 100) -> None:
    with hdf5.ShardWriter(directory, FIELDS, shard_samples=32, chunk_samples=8) as writer:
        writer.append(samples(0, total))


def test_samples_land_in_compressed_chunked_shards_with_an_index(tmp_path: Path) -> None:
    write(tmp_path)
    index = hdf5.read_index(tmp_path)
    assert index is not None
    assert index.complete
    assert [s.samples for s in index.shards] == [32, 32, 32, 4]
    import h5py  # type: ignore[import-untyped]
    with h5py.File(tmp_path / index.shards[0].file) as shard:
        assert shard["x"].compression == "gzip"
        assert shard["x"].chunks == (8, 4)


def test_a_killed_writer_keeps_its_complete_shards_and_continues(tmp_path: Path) -> None:
    writer = hdf5.ShardWriter(tmp_path, FIELDS, shard_samples=32)
    writer.append(samples(0, 50))  # one shard sealed, 18 samples in the one being filled
    del writer  # never closed: as if the step were killed
    again = hdf5.ShardWriter(tmp_path, FIELDS, shard_samples=32)
    assert again.samples_written == 32
    again.append(samples(32, 70))
    index = again.close()
    assert index.samples == 70
    data = hdf5.ShardedBatches(tmp_path, batch_size=10, shuffle=False)
    ys = torch.cat([data[i]["y"] for i in range(len(data))])
    assert ys.tolist() == list(range(70))


def test_a_writer_refuses_other_fields(tmp_path: Path) -> None:
    write(tmp_path, 10)
    with pytest.raises(ValueError, match="holds fields"):
        hdf5.ShardWriter(tmp_path, {"x": ((5,), "float32")})


def test_batches_from_a_cursor_are_the_rest_of_the_same_epoch(tmp_path: Path) -> None:
    write(tmp_path)
    data = hdf5.ShardedBatches(tmp_path, batch_size=8, seed=3)
    assert len(data) == 3 * 4 + 1  # blocks of 8 in each shard of 32, and the last 4 samples
    whole = [b["y"] for b in data.batches(Cursor(epoch=2))]
    rest = [b["y"] for b in data.batches(Cursor(epoch=2, batch=5, step=39))]
    assert all(torch.equal(a, b) for a, b in zip(whole[5:], rest, strict=True))
    assert sorted(torch.cat(whole).tolist()) == list(range(100))
    assert torch.equal(data.batch(2, 7)["y"], whole[7])
    other = [b["y"] for b in data.batches(Cursor(epoch=3))]
    assert not all(torch.equal(a, b) for a, b in zip(whole, other, strict=True))
    assert data.position(40) == (3, 1)


def test_blocks_work_as_a_dataset_with_a_resumable_sampler(tmp_path: Path) -> None:
    write(tmp_path, 64)
    data = hdf5.ShardedBatches(tmp_path, batch_size=16, drop_last=True)
    sampler = ResumableSampler(len(data), seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler)
    batches = list(loader)
    assert len(batches) == 4
    assert batches[0]["x"].shape == (16, 4)
    data.close()
