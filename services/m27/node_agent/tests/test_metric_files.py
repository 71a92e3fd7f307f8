"""Reading a step's metrics file as it grows: complete lines only, bad lines skipped and
counted once, batches with the offsets that make a re-publish recognisable."""

from __future__ import annotations

from pathlib import Path

from m27.node_agent._metric_files import BATCH, BATCH_BYTES, MetricsFile


def test_only_complete_lines_are_read_and_the_offset_moves_past_them(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = MetricsFile(path)
    assert tail.read(1.0) == ([], 0)  # no file yet: the program logs nothing
    path.write_bytes(b'{"step": 1, "loss": 2}\n{"step": 2, "lo')
    chunks, end = tail.read(1.0)
    assert [p.step for c in chunks for p in c.points] == [1]
    assert (chunks[0].offset, end) == (0, 23)
    tail.offset = end
    with path.open("ab") as file:
        file.write(b'ss": 3}\n')
    chunks, end = tail.read(1.0)
    assert [(c.offset, [p.values for p in c.points]) for c in chunks] == [(23, [{"loss": 3.0}])]


def test_bad_lines_are_skipped_and_counted_once_however_often_read(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'not json\n\n{"step": 1, "loss": 2}\n{"step": -4, "loss": 1}\n')
    tail = MetricsFile(path)
    for _ in range(3):  # a publish that failed: the same bytes again
        chunks, end = tail.read(1.0)
    assert [p.step for c in chunks for p in c.points] == [1]
    assert (tail.skipped, tail.first_problem) == (2, "byte 0: not JSON")
    assert end == path.stat().st_size


def test_points_come_in_batches_with_their_offsets(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    lines = [b'{"step": %d, "loss": 1}\n' % i for i in range(BATCH * 2 + 5)]
    path.write_bytes(b"".join(lines))
    chunks, _ = MetricsFile(path).read(1.0)
    assert [len(c.points) for c in chunks] == [BATCH, BATCH, 5]
    assert chunks[1].offset == sum(len(line) for line in lines[:BATCH])


def test_a_line_that_never_ends_is_skipped_not_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"x" * 200_000)
    tail = MetricsFile(path)
    chunks, end = tail.read(1.0)
    assert (chunks, end, tail.skipped) == ([], 200_000, 1)


def test_a_file_the_program_truncates_is_read_again_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2}\n{"step": 2, "loss": 2}\n')
    tail = MetricsFile(path)
    tail.offset = tail.read(1.0)[1]
    path.write_bytes(b'{"step": 3, "loss": 1}\n')  # opened with "w" again
    chunks, _ = tail.read(1.0)
    assert [p.step for c in chunks for p in c.points] == [3]


def test_wide_lines_make_smaller_batches(tmp_path: Path) -> None:
    """Bounded by bytes too: 200 metrics a line still fit a NATS message."""
    path = tmp_path / "m.jsonl"
    wide = b", ".join(b'"metric_%03d": 0.123456789012' % i for i in range(200))
    path.write_bytes(b"".join(b'{"step": %d, %s}\n' % (s, wide) for s in range(300)))
    chunks, _ = MetricsFile(path).read(1.0)
    assert sum(len(c.points) for c in chunks) == 300
    assert all(c.size <= BATCH_BYTES + 64 * 1024 for c in chunks)
    assert len(chunks) > 1
