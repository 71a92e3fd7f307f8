"""Retention (keep the last N and every Mth) and garbage collection's mark and sweep (pure)."""

from __future__ import annotations

import math

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from m27.checkpoint_store._retention import (
    ChunkFile,
    RetentionPolicy,
    choose_protected,
    choose_retained,
    mark,
    removal_time,
    sweep,
)
from m27.common.checkpoint_api import CheckpointSummary
from m27.common.checkpoint_format import Manifest, chunk_ids, plan_entry

TASK = "r-20240101-120000-abc123/train"


def summary(seq: int, *, step: int | None = None, protected: str = "") -> CheckpointSummary:
    return CheckpointSummary(task_id=TASK, checkpoint_id=f"c-{seq:013d}-aaaaaa", attempt=0,
                             name="", step=step, epoch=None, created_at=float(seq),
                             size_bytes=0, new_bytes=0, full=True, entries=0, seq=seq,
                             protected=protected)


def kept(n: int, keep_last: int, keep_every: int) -> list[int]:
    decision = choose_retained([summary(s) for s in range(1, n + 1)],
                               RetentionPolicy(keep_last=keep_last, keep_every=keep_every))
    assert set(decision.keep) | set(decision.delete) == {summary(s).checkpoint_id
                                                         for s in range(1, n + 1)}
    return [int(c.split("-")[1]) for c in decision.keep]


@pytest.mark.parametrize(("n", "keep_last", "keep_every", "expected"), [
    (0, 3, 0, []),
    (2, 3, 0, [1, 2]),
    (3, 3, 0, [1, 2, 3]),
    (5, 3, 0, [3, 4, 5]),
    (12, 2, 5, [5, 10, 11, 12]),
    (10, 2, 5, [5, 9, 10]),
    (7, 1, 0, [7]),
    (7, 0, 0, [1, 2, 3, 4, 5, 6, 7]),  # keep_last = 0: keep everything
    (9, 3, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9]),
])
def test_keep_the_last_n_and_every_mth(n: int, keep_last: int, keep_every: int,
                                       expected: list[int]) -> None:
    assert kept(n, keep_last, keep_every) == expected


def test_every_decision_has_a_reason() -> None:
    decision = choose_retained([summary(s) for s in range(1, 8)],
                               RetentionPolicy(keep_last=2, keep_every=3))
    assert decision.reasons[summary(7).checkpoint_id] == "one of the last 2"
    assert decision.reasons[summary(3).checkpoint_id] == "every 3th is kept (seq 3)"
    assert decision.reasons[summary(1).checkpoint_id] == "older than the last 2"
    assert decision.delete == tuple(summary(s).checkpoint_id for s in (1, 2, 4, 5))


def test_order_comes_from_the_ids_not_the_input() -> None:
    shuffled = [summary(s) for s in (4, 1, 3, 2)]
    decision = choose_retained(shuffled, RetentionPolicy(keep_last=2))
    assert decision.keep == (summary(3).checkpoint_id, summary(4).checkpoint_id)


@given(n=st.integers(0, 40), keep_last=st.integers(0, 6), keep_every=st.integers(0, 7))
def test_the_newest_is_always_kept_and_nothing_is_lost_twice(n: int, keep_last: int,
                                                             keep_every: int) -> None:
    result = kept(n, keep_last, keep_every)
    if n:
        assert result[-1] == n
    assert len(result) >= min(n, keep_last or n)
    again = kept(n, keep_last, keep_every)
    assert again == result


ZSTD = zstandard.ZstdCompressor(level=1)


def manifest(*contents: bytes, delta_of: bytes = b"") -> Manifest:
    """Entries of `contents`; with `delta_of`, each a delta against those bytes."""
    entries = []
    for index, data in enumerate(contents):
        previous = None
        if delta_of:
            previous, _ = plan_entry(f"e{index}", "bytes", memoryview(delta_of), None,
                                     delta=False, compressor=ZSTD)

        def base(i: int) -> bytes:
            return delta_of

        entry, _ = plan_entry(f"e{index}", "bytes", memoryview(data), previous,
                              delta=bool(delta_of), compressor=ZSTD, previous_raw=base)
        entries.append(entry)
    return Manifest(task_id=TASK, entries=tuple(entries))


def test_mark_includes_delta_bases() -> None:
    """A kept delta checkpoint keeps the chunks of its base, even if the base's manifest
    was retired."""
    base = bytes(range(256)) * 64
    delta = manifest(bytes(b ^ 1 if i % 97 == 0 else b for i, b in enumerate(base)),
                     delta_of=base)
    (ref,) = delta.entries[0].chunks
    assert ref.codec == "xor-zstd"
    assert ref.base is not None
    assert mark([delta]) == {ref.id, ref.base.id}


def test_sweep_removes_only_unreferenced_chunks_past_the_grace_period() -> None:
    kept_manifest = manifest(b"kept")
    (used,) = chunk_ids(kept_manifest)
    now = 100_000.0
    files = [ChunkFile(used, now - 99_999), ChunkFile("a" * 64, now - 7200),
             ChunkFile("b" * 64, now - 60), ChunkFile("c" * 64, now - 3600.5)]
    decision = sweep(files, mark([kept_manifest]), marked_at=now, grace_s=3600)
    assert decision.delete == ("a" * 64, "c" * 64)
    assert (decision.referenced, decision.young) == (1, 1)
    assert decision.cutoff == now - 3600


def test_sweep_with_nothing_referenced_and_everything_young_deletes_nothing() -> None:
    files = [ChunkFile(c * 64, 99.0) for c in "abc"]
    assert sweep(files, set(), marked_at=100.0, grace_s=10).delete == ()


@given(st.lists(st.tuples(st.sampled_from("0123456789abcdef"), st.floats(0, 1000)),
                max_size=30),
       st.sets(st.sampled_from("0123456789abcdef")), st.floats(0, 500))
def test_sweep_never_deletes_a_referenced_or_young_chunk(
        chunks: list[tuple[str, float]], referenced: set[str], grace: float) -> None:
    files = [ChunkFile(c * 64, mtime) for c, mtime in dict(chunks).items()]  # ids are unique
    refs = {c * 64 for c in referenced}
    decision = sweep(files, refs, marked_at=1000.0, grace_s=grace)
    for chunk in files:
        if chunk.id in decision.delete:
            assert chunk.id not in refs
            assert chunk.mtime < 1000.0 - grace


@given(st.integers(0, 30), st.integers(0, 5), st.integers(0, 4),
       st.sets(st.integers(1, 30), max_size=5))
def test_a_protected_checkpoint_is_never_deleted(n: int, keep_last: int, keep_every: int,
                                                  protected: set[int]) -> None:
    summaries = [summary(s, protected="anomaly" if s in protected else "")
                 for s in range(1, n + 1)]
    decision = choose_retained(summaries, RetentionPolicy(keep_last=keep_last,
                                                          keep_every=keep_every))
    for s in summaries:
        if s.protected:
            assert s.checkpoint_id in decision.keep
            assert decision.reasons[s.checkpoint_id] == "protected: anomaly"


@pytest.mark.parametrize(("steps", "before_step", "before", "expected"), [
    ([100, 200, 300], 250, 0.0, 2),  # the newest taken before step 250
    ([100, 200, 300], 200, 0.0, 1),  # one taken after step 200 is not from before it
    ([100, 200, 300], 50, 99.0, None),  # none before; the time is not looked at
    ([None, None, None], 250, 2.5, 2),  # no steps: by commit time
    ([100, None, None], 150, 2.5, 2),  # mixed: each by what it has
    ([], 10, 10.0, None),
])
def test_which_checkpoint_an_anomaly_protects(steps: list[int | None], before_step: int,
                                               before: float, expected: int | None) -> None:
    summaries = [summary(i, step=step) for i, step in enumerate(steps, start=1)]
    chosen = choose_protected(summaries, before_step, before)
    assert (chosen.seq if chosen else None) == expected


TIMES = st.floats(min_value=0, max_value=4e9, allow_nan=False)


@given(ended=st.none() | TIMES, keep=st.floats(min_value=0, max_value=1e9))
def test_a_runs_checkpoints_go_keep_finished_after_it_ended_and_never_before(
        ended: float | None, keep: float) -> None:
    removed_at = removal_time(ended, keep)
    if ended is None or keep == 0:
        assert removed_at is None  # still going, unknown, or kept for ever
    else:
        assert removed_at is not None
        assert removed_at >= ended
        # exact up to the rounding of one addition at the time's magnitude (a keep
        # shorter than half a unit in the last place of an epoch time rounds away)
        assert abs((removed_at - ended) - keep) <= math.ulp(removed_at)
