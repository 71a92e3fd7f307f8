"""How a checkpoint is stored: content-addressed chunks and a manifest (pure; the contract
shared by the training library, the node-agent's file uploads and the checkpoint-store).

A checkpoint is a manifest of *entries* (tensors, files, small blobs). Each entry's bytes
are cut into chunks of at most `CHUNK_BYTES`; each chunk is stored as
- `zstd`: zstd-compressed raw bytes, or
- `raw`: the bytes themselves, where compression does not pay (dense float32 training
  state compresses by under 10 %; writing it is faster than compressing it); its id and
  `raw_sha256` are the same hash, computed once.
- `xor-zstd`: zstd of (raw XOR the same chunk of an earlier checkpoint): for a float
  tensor that changed a little, sign, exponent and high mantissa bits mostly agree, so the
  XOR is mostly zero bits and compresses far better than the raw bytes. Only entries of at
  least `[checkpoint] diff_threshold` bytes are stored as deltas. The training library
  stores deltas against the last *full* checkpoint, so a restore decodes at most one
  delta over a full chunk.
A chunk's id is the sha256 of its *stored* bytes (what the store verifies on every write
and read); `raw_sha256` checks the decoded bytes. A chunk whose raw bytes are unchanged
since the previous checkpoint keeps its previous ref: it is neither encoded nor sent nor
stored again (frozen layers, embeddings, LoRA bases cost nothing).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final, Literal

import msgspec
import numpy as np
import zstandard

from m27.common.errors import M27Error

CHUNK_BYTES: Final = 4 * 1024 * 1024
CHUNK_ID_RE: Final = re.compile(r"[0-9a-f]{64}")
Codec = Literal["raw", "zstd", "xor-zstd"]
#: Stored bytes on their way to a store (a memoryview avoids copying a raw chunk).
Payload = bytes | memoryview
EntryKind = Literal["tensor", "file", "bytes"]


class ChunkRef(msgspec.Struct, frozen=True, kw_only=True):
    id: str  # sha256 of the stored bytes
    raw_sha256: str  # sha256 of the decoded bytes
    length: int  # decoded bytes
    stored: int  # stored bytes
    codec: Codec
    base: ChunkRef | None = None  # for xor-zstd: the chunk it is a delta against


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor, file or blob of a checkpoint."""

    name: str
    kind: EntryKind
    size: int
    chunks: tuple[ChunkRef, ...]
    dtype: str = ""  # tensors: torch dtype name, e.g. "float32"
    shape: tuple[int, ...] = ()
    mode: int = 0o644  # files


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint. Committed (visible) only after all of its chunks are durable."""

    task_id: str
    checkpoint_id: str = ""  # assigned by the store at commit
    attempt: int = 0
    name: str = ""  # a label, e.g. "step-1200"
    created_at: float = 0.0
    step: int | None = None  # the training step it was taken after
    epoch: int | None = None
    cursor: dict[str, int] = msgspec.field(default_factory=dict)  # the data cursor
    entries: tuple[Entry, ...] = ()
    full: bool = True  # no deltas: a restore needs no earlier checkpoint
    chain: int = 0  # delta checkpoints since the last full one
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    size_bytes: int = 0  # decoded size of all entries
    new_bytes: int = 0  # bytes of chunks this checkpoint added to the store
    seq: int = 0  # 1, 2, 3, … per task in commit order (set by the store)
    #: Why retention keeps it whatever else it says (set by the store's Protect: the last
    #: checkpoint before a training anomaly); "" for none.
    protected: str = ""

    def entry(self, name: str) -> Entry | None:
        return next((e for e in self.entries if e.name == name), None)


#: Where stored chunk bytes are read from, by id (a local directory, the store).
ChunkSource = Callable[[str], bytes]


class CorruptChunk(M27Error, ValueError):
    """Stored bytes that do not match their id, or decode to bytes that do not match."""


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _xor(a: bytes | memoryview, b: bytes | memoryview) -> bytes:
    out: bytes = np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()
    return out


def encode_chunk(raw: bytes | memoryview, base: tuple[ChunkRef, bytes] | None,
                 compressor: zstandard.ZstdCompressor, *, compress: bool = True,
                 raw_hash: str | None = None) -> tuple[ChunkRef, Payload]:
    """The stored form of one chunk: with `compress`, a delta against `base` (its ref and
    decoded bytes) when that is smaller, else plain zstd; without, the raw bytes.
    `raw_hash`: the sha256 of `raw`, when the caller has it already."""
    raw_hash = raw_hash or sha256(raw)
    if not compress:
        return ChunkRef(id=raw_hash, raw_sha256=raw_hash, length=len(raw), stored=len(raw),
                        codec="raw"), raw
    payload, codec = compressor.compress(raw), "zstd"
    if base is not None and base[0].length == len(raw):
        delta = compressor.compress(_xor(raw, base[1]))
        if len(delta) < len(payload):
            payload, codec = delta, "xor-zstd"
    ref = ChunkRef(id=sha256(payload), raw_sha256=raw_hash, length=len(raw),
                   stored=len(payload), codec=codec,  # type: ignore[arg-type]
                   base=base[0] if codec == "xor-zstd" and base is not None else None)
    return ref, payload


def decode_chunk(ref: ChunkRef, read: ChunkSource,
                 decompressor: zstandard.ZstdDecompressor | None = None,
                 cache: dict[str, bytes] | None = None) -> bytes:
    """The raw bytes of a chunk, following its delta base; every step is verified."""
    if cache is not None and ref.id in cache:
        return cache[ref.id]
    payload = read(ref.id)
    if sha256(payload) != ref.id:
        raise CorruptChunk(f"chunk {ref.id[:12]} does not match its hash")
    if ref.codec == "raw":  # the stored bytes are the raw bytes: one hash checks both
        if len(payload) != ref.length or ref.raw_sha256 != ref.id:
            raise CorruptChunk(f"chunk {ref.id[:12]} decodes to the wrong bytes")
        raw = payload
    else:
        unzip = decompressor or zstandard.ZstdDecompressor()
        raw = unzip.decompress(payload, max_output_size=ref.length)
        if ref.codec == "xor-zstd":
            if ref.base is None:
                raise CorruptChunk(f"delta chunk {ref.id[:12]} has no base")
            raw = _xor(raw, decode_chunk(ref.base, read, unzip, cache))
        if len(raw) != ref.length or sha256(raw) != ref.raw_sha256:
            raise CorruptChunk(f"chunk {ref.id[:12]} decodes to the wrong bytes")
    if cache is not None:
        cache[ref.id] = raw
    return raw


def chunks_of(data: memoryview, chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    for offset in range(0, max(len(data), 1), chunk_bytes):
        yield data[offset:offset + chunk_bytes]


def plan_entry(name: str, kind: EntryKind, data: memoryview, previous: Entry | None,
               *, delta: bool, compressor: zstandard.ZstdCompressor,
               previous_raw: Callable[[int], bytes] | None = None,
               chunk_bytes: int = CHUNK_BYTES, dtype: str = "", shape: Sequence[int] = (),
               mode: int = 0o644, compress: bool = True) -> tuple[Entry, dict[str, bytes]]:
    """An entry of `data` and the chunks to store for it (id → stored bytes).

    A chunk whose raw bytes equal the previous checkpoint's chunk at the same place keeps
    that ref and adds nothing. With `delta`, a changed chunk may be stored as an XOR delta
    against the previous one (`previous_raw(i)` gives its decoded bytes)."""
    refs: list[ChunkRef] = []
    new: dict[str, bytes] = {}
    old = previous.chunks if previous is not None and previous.size == len(data) else ()
    for index, raw in enumerate(chunks_of(data, chunk_bytes)):
        before = old[index] if index < len(old) else None
        raw_hash = sha256(raw)
        if before is not None and before.length == len(raw) and before.raw_sha256 == raw_hash:
            refs.append(before)
            continue
        base = None
        if delta and compress and before is not None and previous_raw is not None:
            base = (before, previous_raw(index))
        ref, payload = encode_chunk(raw, base, compressor, compress=compress,
                                    raw_hash=raw_hash)
        refs.append(ref)
        new.setdefault(ref.id, bytes(payload))
    entry = Entry(name=name, kind=kind, size=len(data), chunks=tuple(refs), dtype=dtype,
                  shape=tuple(shape), mode=mode)
    return entry, new


def read_entry(entry: Entry, read: ChunkSource, cache: dict[str, bytes] | None = None) -> bytes:
    unzip = zstandard.ZstdDecompressor()
    return b"".join(decode_chunk(ref, read, unzip, cache) for ref in entry.chunks)


def chunk_ids(manifest: Manifest) -> set[str]:
    """Every chunk a manifest needs, delta bases included (what garbage collection keeps)."""
    found: set[str] = set()
    for entry in manifest.entries:
        for ref in entry.chunks:
            node: ChunkRef | None = ref
            while node is not None:
                found.add(node.id)
                node = node.base
    return found


def chain_depth(ref: ChunkRef) -> int:
    depth, node = 0, ref.base
    while node is not None:
        depth, node = depth + 1, node.base
    return depth


def stored_size(new_chunks: Mapping[str, Payload]) -> int:
    return sum(len(v) for v in new_chunks.values())


def is_chunk_id(value: str) -> bool:
    return CHUNK_ID_RE.fullmatch(value) is not None
