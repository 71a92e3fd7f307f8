"""Checkpoint, task, run and chunk ids and KV keys: what is accepted, what never escapes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.checkpoint_store._ids import (
    CheckpointRef,
    checkpoint_id_ms,
    is_valid_checkpoint_id,
    new_checkpoint_id,
    next_id_ms,
    parse_chunk_ids,
    parse_ref,
    parse_run_id,
    parse_task_id,
    ref_from_key,
    shown,
)
from m27.common.checkpoint_api import InvalidCheckpointRequest

RUN = "r-20240101-120000-abc123"
GOOD_ID = "c-1704110400000-0a1b2c"


@pytest.mark.parametrize(("value", "valid"), [
    (GOOD_ID, True),
    ("c-0000000000000-000000", True),
    ("", False),
    ("c-1704110400000-0A1B2C", False),  # upper-case hex
    ("c-170411040000-0a1b2c", False),  # 12 digits
    ("c-1704110400000-0a1b2c.blob", False),
    ("c-1704110400000-0a1b2c\n", False),  # `$` alone would accept this
    ("c-\u0661704110400000-0a1b2c", False),  # an Arabic-Indic digit: `\d` would accept it
    ("../c-1704110400000-0a1b2c", False),
    ("c-1704110400000-0a1b2c/..", False),
    ("/etc/passwd", False),
    ("..", False),
    ("*", False),
    (">", False),
])
def test_checkpoint_id_pattern(value: str, valid: bool) -> None:
    """Only the exact `c-<13 digits>-<6 hex>` form is an id."""
    assert is_valid_checkpoint_id(value) is valid


def test_new_checkpoint_id_round_trips_its_time() -> None:
    """The id carries its commit time and sorts by it."""
    early, late = new_checkpoint_id(5, "abcdef"), new_checkpoint_id(1704110400000, "000000")
    assert early == "c-0000000000005-abcdef"
    assert checkpoint_id_ms(late) == 1704110400000
    assert early < late
    assert is_valid_checkpoint_id(early)
    assert is_valid_checkpoint_id(late)


@pytest.mark.parametrize(("ms", "token"), [(-1, "abcdef"), (10**13, "abcdef"), (1, "ABCDEF"),
                                           (1, "abc"), (1, "../../")])
def test_new_checkpoint_id_refuses_bad_parts(ms: int, token: str) -> None:
    with pytest.raises(ValueError, match="cannot form"):
        new_checkpoint_id(ms, token)


@pytest.mark.parametrize(("now", "last", "expected"), [
    (100, 0, 100),
    (100, 99, 100),
    (100, 100, 101),  # same millisecond: still strictly later
    (100, 500, 501),  # clock stepped back: never reuse or go backwards
])
def test_next_id_ms_strictly_increases(now: int, last: int, expected: int) -> None:
    assert next_id_ms(now, last) == expected


@pytest.mark.parametrize("task_id", [
    "../../etc",
    "r-x/../y",
    "/etc/passwd",
    f"{RUN}/../x",
    f"{RUN}/",
    f"{RUN}/a/b",
    f"{RUN}/.hidden",
    f"{RUN}/a.b",
    f"{RUN}/*",
    "r-2024/train",
    "",
    f"{RUN}/" + "x" * 101,
    f"{RUN}/train\n",
    f"{RUN}\n/train",
    "r-2024010\u0661-120000-abc123/train",
])
def test_hostile_task_ids_are_rejected(task_id: str) -> None:
    """Nothing but `<run_id>/<step>` with safe names gets past validation."""
    with pytest.raises(InvalidCheckpointRequest, match="task_id must be"):
        parse_task_id(task_id)


def test_parse_ref_maps_to_its_key() -> None:
    ref = parse_ref(f"{RUN}/train", GOOD_ID)
    assert ref == CheckpointRef(RUN, "train", GOOD_ID)
    assert ref.task_id == f"{RUN}/train"
    assert ref.key == f"{RUN}.train.{GOOD_ID}"
    assert ref_from_key(ref.key) == ref


@pytest.mark.parametrize(("checkpoint_id", "message"), [
    ("", "checkpoint_id is required"),
    ("../../etc/passwd", "checkpoint_id must look like"),
    ("c-1/../../x", "checkpoint_id must look like"),
])
def test_parse_ref_rejects_bad_checkpoint_ids(checkpoint_id: str, message: str) -> None:
    with pytest.raises(InvalidCheckpointRequest, match=message):
        parse_ref(f"{RUN}/train", checkpoint_id)


@pytest.mark.parametrize("key", ["", "a.b.c", f"{RUN}.train", f"{RUN}.train.{GOOD_ID}.x",
                                 f"{RUN}.tr*in.{GOOD_ID}"])
def test_foreign_keys_are_not_refs(key: str) -> None:
    assert ref_from_key(key) is None


def test_shown_keeps_error_messages_short() -> None:
    """A megabyte of hostile input becomes a short, quoted excerpt."""
    assert shown("abc") == "'abc'"
    long = shown("x" * 1_000_000)
    assert len(long) < 120
    assert "1000000 chars" in long


@given(task_id=st.text(max_size=60), checkpoint_id=st.text(max_size=40))
def test_any_input_either_fails_cleanly_or_makes_a_plain_key(task_id: str,
                                                             checkpoint_id: str) -> None:
    """Arbitrary text never crashes validation, and an accepted ref is a key of exactly
    three plain tokens: no wildcard, no path separator, nothing to escape with."""
    try:
        ref = parse_ref(task_id, checkpoint_id)
    except InvalidCheckpointRequest:
        return
    tokens = ref.key.split(".")
    assert len(tokens) == 3
    assert all(t and "*" not in t and ">" not in t and "/" not in t for t in tokens)


@pytest.mark.parametrize(("run_id", "valid"), [
    (RUN, True), (f"{RUN}\n", False), ("r-2024", False), ("*", False), ("", False),
    (f"{RUN}.x", False), ("../r-20240101-120000-abc123", False)])
def test_run_ids(run_id: str, valid: bool) -> None:
    if valid:
        assert parse_run_id(run_id) == run_id
    else:
        with pytest.raises(InvalidCheckpointRequest, match="run_id must look like"):
            parse_run_id(run_id)


@pytest.mark.parametrize("chunk_id", ["", "a" * 63, "a" * 65, "A" * 64, "../" + "a" * 61,
                                      "a" * 63 + "\n", "g" * 64])
def test_hostile_chunk_ids_are_refused(chunk_id: str) -> None:
    with pytest.raises(InvalidCheckpointRequest, match="64 lower-case hex"):
        parse_chunk_ids(["a" * 64, chunk_id], 10)


def test_too_many_chunk_ids_in_one_request() -> None:
    assert parse_chunk_ids(["a" * 64] * 3, 3) == ["a" * 64] * 3
    with pytest.raises(InvalidCheckpointRequest, match="at most 3 chunk ids"):
        parse_chunk_ids(["a" * 64] * 4, 3)


@given(run_token=st.from_regex(r"[0-9a-f]{6}", fullmatch=True),
       step=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True),
       ms=st.integers(0, 10**13 - 1), token=st.from_regex(r"[0-9a-f]{6}", fullmatch=True))
def test_valid_refs_round_trip_through_their_key(run_token: str, step: str, ms: int,
                                                 token: str) -> None:
    ref = parse_ref(f"r-20240101-120000-{run_token}/{step}", new_checkpoint_id(ms, token))
    assert ref_from_key(ref.key) == ref
