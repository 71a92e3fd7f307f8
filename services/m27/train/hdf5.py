"""A resumable HDF5 dataset: a CPU step writes chunked, compressed shards; training reads
batches by (epoch, batch index), so the data cursor resumes mid-epoch. Needs h5py
(`pip install m27[hdf5]`).

    with ShardWriter(out, {"x": ((3, 32, 32), "uint8"), "y": ((), "int64")}) as writer:
        for xs, ys in source(skip=writer.samples_written):    # resumes after a restart
            writer.append({"x": xs, "y": ys})

    data = ShardedBatches(out, batch_size=256, seed=0)
    for batch in data.batches(cursor):                        # from the cursor's batch on
        ...

Layout: `shard-00000.h5`, ... and `index.json`. A shard is written under a temporary name,
fsynced and renamed; `index.json` is rewritten (durably) after each shard, so a killed
writer loses at most the shard it was filling. A batch is a contiguous block of
`batch_size` samples of one shard (one or two compressed chunks to read, not one per
sample): the epoch shuffles the order of blocks, and the rows inside each block, from
(seed, epoch) alone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import torch

from m27.common.checkpoint_storage import fsync_dir, write_durably
from m27.train._cursor import epoch_order, epoch_seed

try:
    import h5py  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - the hdf5 extra is not installed
    raise ImportError("m27.train.hdf5 needs h5py: pip install 'm27[hdf5]'") from exc

INDEX: Final = "index.json"
Fields = Mapping[str, tuple[tuple[int, ...], str]]  # name → (per-sample shape, dtype)


class Shard(msgspec.Struct, frozen=True):
    file: str
    samples: int


class Index(msgspec.Struct, frozen=True, kw_only=True):
    fields: dict[str, tuple[tuple[int, ...], str]]
    shards: tuple[Shard, ...] = ()
    complete: bool = False  # the writer was closed: no more shards will come

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)


def read_index(directory: Path) -> Index | None:
    path = directory / INDEX
    return msgspec.json.decode(path.read_bytes(), type=Index) if path.is_file() else None


class ShardWriter:
    """Appends samples to compressed HDF5 shards of `shard_samples` samples each."""

    def __init__(self, directory: str | os.PathLike[str], fields: Fields, *,
                 shard_samples: int = 65_536, chunk_samples: int = 256,
                 compression: str = "gzip", level: int | None = 4) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard_samples, self.chunk_samples = shard_samples, chunk_samples
        self.compression, self.level = compression, level
        wanted = {k: (tuple(shape), str(np.dtype(dt))) for k, (shape, dt) in fields.items()}
        self.index = read_index(self.directory) or Index(fields=wanted)
        if self.index.fields != wanted:
            raise ValueError(f"{self.directory} holds fields {self.index.fields}, not {wanted}")
        for stray in self.directory.glob(".tmp-shard-*"):
            stray.unlink()
        self._file: Any = None
        self._filled = 0

    @property
    def samples_written(self) -> int:
        """Samples in complete shards (what survives a restart: continue from here)."""
        return self.index.samples

    def append(self, batch: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        arrays = {k: np.asarray(v) for k, v in batch.items()}
        count = len(next(iter(arrays.values())))
        start = 0
        while start < count:
            if self._file is None:
                self._open()
            take = min(count - start, self.shard_samples - self._filled)
            for name, array in arrays.items():
                dataset = self._file[name]
                dataset.resize(self._filled + take, axis=0)
                dataset[self._filled:self._filled + take] = array[start:start + take]
            self._filled += take
            start += take
            if self._filled == self.shard_samples:
                self._seal()

    def close(self) -> Index:
        if self._file is not None and self._filled:
            self._seal()
        elif self._file is not None:
            self._file.close()
            Path(self._file_path).unlink()
            self._file = None
        self.index = msgspec.structs.replace(self.index, complete=True)
        write_durably(self.directory / INDEX, msgspec.json.encode(self.index))
        return self.index

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        number = len(self.index.shards)
        self._file_path = str(self.directory / f".tmp-shard-{number:05d}.h5")
        self._file = h5py.File(self._file_path, "w")
        for name, (shape, dtype) in self.index.fields.items():
            self._file.create_dataset(
                name, shape=(0, *shape), maxshape=(None, *shape), dtype=dtype,
                chunks=(self.chunk_samples, *shape), compression=self.compression,
                compression_opts=self.level if self.compression == "gzip" else None,
                shuffle=True)
        self._filled = 0

    def _seal(self) -> None:
        self._file.close()
        self._file = None
        tmp = Path(self._file_path)
        with tmp.open("rb+") as handle:
            os.fsync(handle.fileno())
        final = tmp.with_name(tmp.name.removeprefix(".tmp-"))
        os.replace(tmp, final)
        fsync_dir(self.directory)
        shards = (*self.index.shards, Shard(final.name, self._filled))
        self.index = msgspec.structs.replace(self.index, shards=shards)
        write_durably(self.directory / INDEX, msgspec.json.encode(self.index))


@dataclass(frozen=True)
class Block:
    shard: int
    start: int
    stop: int


class ShardedBatches(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Batches of an HDF5 shard set. Item `i` is block `i` (a batch, rows shuffled only
    by `batch`); `batches(cursor)` walks one epoch in its shuffled order from the cursor.
    As a map-style dataset it also works with `DataLoader(..., batch_size=None,
    sampler=ResumableSampler(len(data), seed=...))` and worker processes."""

    def __init__(self, directory: str | os.PathLike[str], batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False,
                 fields: tuple[str, ...] | None = None) -> None:
        self.directory = Path(directory)
        index = read_index(self.directory)
        if index is None or not index.shards:
            raise FileNotFoundError(f"no HDF5 shards in {self.directory}")
        self.index, self.batch_size, self.seed = index, batch_size, seed
        self.shuffle, self.fields = shuffle, fields or tuple(index.fields)
        self.blocks = [Block(i, start, min(start + batch_size, shard.samples))
                       for i, shard in enumerate(index.shards)
                       for start in range(0, shard.samples, batch_size)
                       if not drop_last or start + batch_size <= shard.samples]
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.blocks)

    def position(self, global_batch: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of a global batch index."""
        return divmod(global_batch, len(self.blocks))

    def __getitem__(self, block: int) -> dict[str, torch.Tensor]:
        return self.read(block, epoch=None)

    def batch(self, epoch: int, batch: int) -> dict[str, torch.Tensor]:
        """Batch `batch` of `epoch`, the same in every process."""
        order = epoch_order(len(self.blocks), self.seed, epoch, self.shuffle)
        return self.read(int(order[batch]), epoch=epoch)

    def batches(self, cursor: Any) -> Iterator[dict[str, torch.Tensor]]:
        """The rest of the cursor's epoch, from its batch on (a `Cursor`)."""
        order = epoch_order(len(self.blocks), self.seed, cursor.epoch, self.shuffle)
        for block in order[cursor.batch:].tolist():
            yield self.read(block, epoch=cursor.epoch)

    def read(self, block: int, epoch: int | None) -> dict[str, torch.Tensor]:
        where = self.blocks[block]
        handle = self._file(where.shard)
        rows = {name: handle[name][where.start:where.stop] for name in self.fields}
        if self.shuffle and epoch is not None:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed + block, epoch))
            perm = torch.randperm(where.stop - where.start, generator=generator).numpy()
            rows = {name: array[perm] for name, array in rows.items()}
        return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in rows.items()}

    def _file(self, shard: int) -> Any:
        if os.getpid() != self._pid:  # a DataLoader worker: HDF5 handles do not survive fork
            self._files, self._pid = {}, os.getpid()
        if shard not in self._files:
            path = self.directory / self.index.shards[shard].file
            self._files[shard] = h5py.File(path, "r")
        return self._files[shard]

    def close(self) -> None:
        for handle in self._files.values():
            with contextlib.suppress(Exception):
                handle.close()
        self._files.clear()
