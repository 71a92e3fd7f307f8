"""Put headers: what is accepted, and the message a bad one gets."""

from __future__ import annotations

import pytest

from m27.checkpoint_store._errors import CheckpointCorrupt, InvalidCheckpointRequest
from m27.checkpoint_store._ids import CheckpointRef
from m27.checkpoint_store._model import (
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_NAME_CHARS,
    CheckpointRecord,
    Header,
    check_record,
    validate_header,
)

TASK = "r-20240101-120000-abc123/train"


def test_a_good_header_is_accepted() -> None:
    header = validate_header(task_id=TASK, attempt=2, name="epoch-3",
                             metadata={"epoch": "3", "loss": "0.12"})
    assert header == Header(run_id="r-20240101-120000-abc123", step="train", attempt=2,
                            name="epoch-3", metadata={"epoch": "3", "loss": "0.12"})
    assert header.task_id == TASK


@pytest.mark.parametrize(("changes", "message"), [
    ({"task_id": ""}, "task_id must be"),
    ({"task_id": "../../etc"}, "task_id must be"),
    ({"attempt": -1}, "attempt must be 0 or more"),
    ({"name": "x" * (MAX_NAME_CHARS + 1)}, "name must be at most 200"),
    ({"metadata": {f"k{i}": "" for i in range(MAX_METADATA_ENTRIES + 1)}}, "at most 64 entries"),
    ({"metadata": {"": "v"}}, "keys must not be empty"),
    ({"metadata": {"k": "v" * MAX_METADATA_BYTES}}, "at most 65536 bytes"),
])
def test_bad_headers_are_rejected_with_a_reason(changes: dict[str, object],
                                                message: str) -> None:
    fields: dict[str, object] = {"task_id": TASK, "attempt": 0, "name": "", "metadata": {}}
    fields.update(changes)
    with pytest.raises(InvalidCheckpointRequest, match=message):
        validate_header(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "metadata"), [
    ("x" * MAX_NAME_CHARS, {}),
    ("", {f"k{i}": "v" for i in range(MAX_METADATA_ENTRIES)}),
    ("", {"k": "v" * (MAX_METADATA_BYTES - 1)}),
])
def test_limits_are_inclusive(name: str, metadata: dict[str, str]) -> None:
    assert validate_header(task_id=TASK, attempt=0, name=name, metadata=metadata).name == name


def test_a_record_read_under_another_key_is_corrupt() -> None:
    """A record that does not describe the key it was stored under is never trusted."""
    record = CheckpointRecord(task_id=TASK, checkpoint_id="c-0000000000001-aaaaaa", attempt=0,
                              name="", size_bytes=0, sha256="", created_at=0.001)
    assert check_record(record, record.ref) is record
    other = CheckpointRef("r-20240101-120000-abc123", "train", "c-0000000000002-aaaaaa")
    with pytest.raises(CheckpointCorrupt, match="describes"):
        check_record(record, other)
