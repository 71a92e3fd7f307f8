"""Manifest validation on Commit, and what the store fills in when it seals one (pure)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from m27.checkpoint_store._manifests import (
    MAX_DELTA_DEPTH,
    MAX_MANIFEST_BYTES,
    decode_manifest,
    entry_name_problem,
    seal,
    stored_sizes,
)
from m27.common.checkpoint_api import CheckpointTooLarge, InvalidCheckpointRequest, summarize
from m27.common.checkpoint_format import Manifest, chunk_ids, plan_entry

TASK = "r-20240101-120000-abc123/train"
ZSTD = zstandard.ZstdCompressor(level=3)
H = "ab" * 32


def floats(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32).tobytes()


def good(**changes: Any) -> dict[str, Any]:
    """A valid manifest as plain JSON data, with `changes` applied at the top level."""
    weights, _ = plan_entry("model/w", "tensor", memoryview(floats(70_000)), None, delta=False,
                            compressor=ZSTD, chunk_bytes=65536, dtype="float32",
                            shape=(70_000,))
    blob, _ = plan_entry("optimizer.pt", "file", memoryview(b"x" * 1000), None, delta=False,
                         compressor=ZSTD)
    manifest = Manifest(task_id=TASK, attempt=2, name="step-100", step=100, epoch=1,
                        cursor={"shard": 3, "offset": 12}, entries=(weights, blob),
                        metadata={"loss": "0.5"})
    data: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(manifest))
    data.update(changes)
    return data


def decode(data: dict[str, Any] | bytes, max_bytes: int = 1 << 40) -> Manifest:
    raw = data if isinstance(data, bytes) else msgspec.json.encode(data)
    return decode_manifest(raw, task_id=TASK, attempt=2, max_bytes=max_bytes)


def with_first_chunk(**changes: Any) -> dict[str, Any]:
    data = good()
    data["entries"][0]["chunks"][0].update(changes)
    return data


def test_a_good_manifest_is_accepted_as_sent() -> None:
    manifest = decode(good())
    assert manifest == msgspec.convert(good(), Manifest)
    assert manifest.entry("model/w") is not None


@pytest.mark.parametrize(("data", "message"), [
    (b"{not json", "is not a manifest"),
    (b'{"task_id": 5}', "is not a manifest"),
    (good(task_id="r-20240101-120000-abc123/other"), "the request of"),
    (good(attempt=1), "attempt 1, the request of 2"),
    (good(checkpoint_id="c-0000000000001-aaaaaa"), "assigned by the store"),
    (good(name="x" * 201), "name must be at most 200"),
    (good(step=-1), "step must be 0 or more"),
    (good(epoch=2**63), "epoch must be 0 or more"),
    (good(metadata={f"k{i}": "" for i in range(65)}), "at most 64 entries"),
    (good(metadata={"": "v"}), "keys must not be empty"),
    (good(cursor={f"k{i}": 1 for i in range(257)}), "cursor may have at most 256"),
    (with_first_chunk(id="../../etc/passwd"), "is not a sha256"),
    (with_first_chunk(id=H.upper()), "is not a sha256"),
    (with_first_chunk(raw_sha256="nope"), "is not a sha256"),
    (with_first_chunk(length=-1), "do not add up"),
    (with_first_chunk(stored=-5), "bad size"),
    (with_first_chunk(stored=64 << 20), "bad size"),
    (with_first_chunk(codec="xor-zstd"), "needs a base"),
    (with_first_chunk(codec="gzip"), "is not a manifest"),
])
def test_bad_manifests_are_refused_with_a_reason(data: dict[str, Any] | bytes,
                                                 message: str) -> None:
    with pytest.raises(InvalidCheckpointRequest, match=message):
        decode(data)


def test_entries_must_add_up_and_be_unique() -> None:
    data = good()
    data["entries"][1]["size"] += 1
    with pytest.raises(InvalidCheckpointRequest, match="do not add up"):
        decode(data)
    data = good()
    data["entries"][1]["name"] = "model/w"
    with pytest.raises(InvalidCheckpointRequest, match="two entries are named"):
        decode(data)


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a",
                                  "a/.", "a\\..\\b", "a\x00b", "tab\there", "x" * 1025])
def test_entry_names_that_could_escape_a_directory_are_refused(name: str) -> None:
    data = good()
    data["entries"][1]["name"] = name
    with pytest.raises(InvalidCheckpointRequest, match="entry name"):
        decode(data)


@pytest.mark.parametrize("name", ["w", "model.layers.0.weight", "sub/dir/state.cpt",
                                  "ünïcode", "a..b", ".hidden"])
def test_ordinary_entry_names_are_fine(name: str) -> None:
    assert entry_name_problem(name) == ""


@given(st.text(max_size=40))
def test_an_accepted_name_never_leaves_its_directory(name: str) -> None:
    import posixpath

    if entry_name_problem(name):
        return
    joined = posixpath.normpath(posixpath.join("/restore", name))
    assert joined.startswith("/restore/")


def test_a_delta_chain_past_the_limit_is_refused() -> None:
    ref: dict[str, Any] = {"id": H, "raw_sha256": H, "length": 4, "stored": 4, "codec": "zstd"}
    for _ in range(MAX_DELTA_DEPTH + 1):
        ref = {"id": H, "raw_sha256": H, "length": 4, "stored": 4, "codec": "xor-zstd",
               "base": ref}
    data = good(entries=[{"name": "w", "kind": "bytes", "size": 4, "chunks": [ref]}])
    with pytest.raises(InvalidCheckpointRequest, match="delta chain longer"):
        decode(data)


def test_size_limits() -> None:
    """The decoded total against max_size; the JSON itself against what KV holds."""
    total = sum(e["size"] for e in good()["entries"])
    assert decode(good(), max_bytes=total).size_bytes == 0  # the store fills it in later
    with pytest.raises(CheckpointTooLarge, match=f"at most {total - 1} bytes"):
        decode(good(), max_bytes=total - 1)
    huge = msgspec.json.encode(good(metadata={"k": "v" * MAX_MANIFEST_BYTES}))
    with pytest.raises(CheckpointTooLarge, match="manifest may be at most"):
        decode(huge)


def test_seal_fills_in_what_the_store_knows() -> None:
    """Sizes come from the entries, not the client; new_bytes counts only chunks the
    previous checkpoint did not use; full means no deltas."""
    first = decode(good(size_bytes=1, new_bytes=1, full=False))
    sealed = seal(first, checkpoint_id="c-0000000000001-aaaaaa", now=5.0, seq=1,
                  previous=None)
    assert isinstance(sealed, Manifest)
    assert (sealed.checkpoint_id, sealed.created_at, sealed.seq) == \
        ("c-0000000000001-aaaaaa", 5.0, 1)
    assert sealed.size_bytes == 70_000 * 4 + 1000
    assert sealed.new_bytes == sum(stored_sizes(first).values())
    assert sealed.full is True
    assert sealed.entries == first.entries
    data = good()
    data["entries"][1] = msgspec.to_builtins(plan_entry(
        "optimizer.pt", "file", memoryview(b"y" * 1000), None, delta=False,
        compressor=ZSTD)[0])
    second = seal(decode(data), checkpoint_id="c-0000000000002-aaaaaa", now=6.0, seq=2,
                  previous=sealed)
    changed = chunk_ids(second) - chunk_ids(sealed)
    assert len(changed) == 1
    assert second.new_bytes == second.entries[1].chunks[0].stored


def test_a_delta_checkpoint_is_not_full() -> None:
    raw = floats(16384)
    base, _ = plan_entry("w", "tensor", memoryview(raw), None, delta=False, compressor=ZSTD)
    updated = (np.frombuffer(raw, np.float32) * np.float32(1.0001)).tobytes()
    delta, _ = plan_entry("w", "tensor", memoryview(updated), base, delta=True,
                          compressor=ZSTD, previous_raw=lambda i: raw)
    assert delta.chunks[0].codec == "xor-zstd"
    manifest = decode(good(entries=[msgspec.to_builtins(delta)], chain=1))
    sealed = seal(manifest, checkpoint_id="c-0000000000003-aaaaaa", now=1.0, seq=3,
                  previous=None)
    assert sealed.full is False
    assert set(stored_sizes(sealed)) == {delta.chunks[0].id, base.chunks[0].id}


def test_summary_keeps_the_listing_fields() -> None:
    sealed = seal(decode(good()), checkpoint_id="c-0000000000001-aaaaaa", now=5.0, seq=4,
                  previous=None)
    summary = summarize(sealed)
    assert (summary.task_id, summary.attempt, summary.name, summary.step, summary.epoch,
            summary.entries, summary.seq, summary.metadata) == \
        (TASK, 2, "step-100", 100, 1, 2, 4, {"loss": "0.5"})
    assert summary.size_bytes == sealed.size_bytes
    assert summary.new_bytes == sealed.new_bytes


def test_a_stored_manifest_reads_as_a_plain_manifest() -> None:
    """Clients decode GetManifest's JSON as `Manifest`; the extra `seq` is ignored."""
    sealed = seal(decode(good()), checkpoint_id="c-0000000000001-aaaaaa", now=5.0, seq=4,
                  previous=None)
    plain = msgspec.json.decode(msgspec.json.encode(sealed), type=Manifest)
    assert plain.checkpoint_id == sealed.checkpoint_id
    assert plain.entries == sealed.entries
