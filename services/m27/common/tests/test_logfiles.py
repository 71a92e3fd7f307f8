"""Reading step logs: where they are, what is refused (links, FIFOs), chunking, following."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from m27.common import logfiles
from m27.common.logfiles import CHUNK_BYTES, LogChunk, LogQuery

RUN = "r-20250101-120000-abcdef"


def write_log(home: Path, name: str, data: bytes) -> Path:
    path = home / "runs" / RUN / "logs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def query(**changes: object) -> LogQuery:
    fields: dict[str, object] = {"run_id": RUN, "step": "train", "attempt": 1}
    fields.update(changes)
    return LogQuery(**fields)  # type: ignore[arg-type]


async def read_all(files: list[logfiles.LogFile], **options: object) -> list[LogChunk]:
    try:
        return [c async for c in logfiles.tail(files, **options)]  # type: ignore[arg-type]
    finally:
        logfiles.close_all(files)


@pytest.mark.parametrize(("value", "expected"), [
    ("", ("stdout", "stderr")), ("both", ("stdout", "stderr")), ("stdout", ("stdout",)),
    ("stderr", ("stderr",)),
])
def test_streams_are_parsed(value: str, expected: tuple[str, ...]) -> None:
    assert logfiles.parse_streams(value) == expected


def test_an_unknown_stream_is_refused() -> None:
    with pytest.raises(ValueError, match="stdout, stderr or both"):
        logfiles.parse_streams("stdin")


@pytest.mark.parametrize(("size", "tail", "start"), [
    (100, 0, 0), (100, 10, 90), (100, 500, 0), (0, 10, 0),
])
def test_the_tail_starts_that_many_bytes_before_the_end(size: int, tail: int,
                                                        start: int) -> None:
    assert logfiles.start_offset(size, tail) == start


async def test_a_big_log_comes_in_chunks_of_at_most_64_kib_with_their_offsets(
        tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK_BYTES + 123)
    write_log(tmp_path, "train.1.out", data)
    chunks = await read_all(logfiles.open_logs(tmp_path, query(streams=("stdout",))))
    assert all(len(c.data) <= CHUNK_BYTES for c in chunks)
    assert b"".join(c.data for c in chunks) == data
    assert [c.offset for c in chunks] == [0, CHUNK_BYTES, 2 * CHUNK_BYTES, 3 * CHUNK_BYTES]


async def test_both_streams_and_the_tail_of_each(tmp_path: Path) -> None:
    write_log(tmp_path, "train.1.out", b"line 1\nline 2\n")
    write_log(tmp_path, "train.1.err", b"warn\n")
    chunks = await read_all(logfiles.open_logs(tmp_path, query(tail_bytes=7)))
    assert [(c.stream, c.data, c.offset) for c in chunks] == [
        ("stdout", b"line 2\n", 7), ("stderr", b"warn\n", 0)]


async def test_a_stream_asked_for_by_name_must_exist_of_both_one_is_enough(
        tmp_path: Path) -> None:
    write_log(tmp_path, "train.1.out", b"x")
    with pytest.raises(logfiles.LogNotFound, match=r"train\.1\.err"):
        logfiles.open_logs(tmp_path, query(streams=("stderr",)))
    chunks = await read_all(logfiles.open_logs(tmp_path, query()))
    assert [c.stream for c in chunks] == ["stdout"]
    with pytest.raises(logfiles.LogNotFound):
        logfiles.open_logs(tmp_path, query(attempt=2))


def test_a_symlinked_log_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("private")
    logs = tmp_path / "runs" / RUN / "logs"
    logs.mkdir(parents=True)
    (logs / "train.1.out").symlink_to(secret)
    with pytest.raises(logfiles.LogError, match="symbolic link"):
        logfiles.open_log(tmp_path, RUN, "train", 1, "stdout")


def test_a_symlinked_logs_directory_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "train.1.out").write_text("not a log")
    run = tmp_path / "runs" / RUN
    run.mkdir(parents=True)
    (run / "logs").symlink_to(elsewhere)
    with pytest.raises(logfiles.LogError, match="symbolic link"):
        logfiles.open_log(tmp_path, RUN, "train", 1, "stdout")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    logs = tmp_path / "runs" / RUN / "logs"
    logs.mkdir(parents=True)
    os.mkfifo(logs / "train.1.out")
    with pytest.raises(logfiles.LogError, match="not a regular file"):
        logfiles.open_log(tmp_path, RUN, "train", 1, "stdout")


@pytest.mark.parametrize(("run_id", "step", "attempt"), [
    ("..", "train", 1), (RUN, "../x", 1), (RUN, "train", 0),
])
def test_ids_that_are_not_names_never_reach_the_file_system(tmp_path: Path, run_id: str,
                                                            step: str, attempt: int) -> None:
    with pytest.raises(ValueError, match="not a log of a task attempt"):
        logfiles.open_log(tmp_path, run_id, step, attempt, "stdout")


async def test_without_follow_reading_stops_at_the_size_when_opened(tmp_path: Path) -> None:
    path = write_log(tmp_path, "train.1.out", b"before\n")
    files = logfiles.open_logs(tmp_path, query(streams=("stdout",)))
    with path.open("ab") as out:
        out.write(b"after\n")
    chunks = await read_all(files)
    assert b"".join(c.data for c in chunks) == b"before\n"


async def test_follow_reads_new_bytes_until_the_task_ends_and_then_drains(
        tmp_path: Path) -> None:
    path = write_log(tmp_path, "train.1.out", b"")
    running = True

    async def still_running() -> bool:
        return running

    files = logfiles.open_logs(tmp_path, query(streams=("stdout",), follow=True))
    got: list[bytes] = []

    async def consume() -> None:
        got.extend(c.data for c in await read_all(files, follow=True,
                                                  still_running=still_running,
                                                  poll_s=0.01))

    reader = asyncio.create_task(consume())
    with path.open("ab", buffering=0) as out:
        for i in range(3):
            out.write(f"line {i}\n".encode())
            await asyncio.sleep(0.05)
        assert b"".join(got) == b""  # `got` is filled only when the stream ends
        assert not reader.done()
        out.write(b"last words\n")
        running = False
    await asyncio.wait_for(reader, 5)
    assert b"".join(got) == b"line 0\nline 1\nline 2\nlast words\n"


async def test_a_truncated_log_is_read_again_from_its_start(tmp_path: Path) -> None:
    path = write_log(tmp_path, "train.1.out", b"0123456789")
    [file] = logfiles.open_logs(tmp_path, query(streams=("stdout",), follow=True))
    try:
        assert file.read() == LogChunk(stream="stdout", data=b"0123456789", offset=0)
        path.write_bytes(b"new")
        assert file.read() == LogChunk(stream="stdout", data=b"new", offset=0)
        assert file.read() is None
    finally:
        file.close()


async def test_resuming_continues_after_what_was_already_sent(tmp_path: Path) -> None:
    write_log(tmp_path, "train.1.out", b"abcdef")
    write_log(tmp_path, "train.1.err", b"uvwxyz")
    files = logfiles.open_logs(tmp_path, query(tail_bytes=2), resume={"stdout": 4})
    chunks = await read_all(files)
    assert [(c.stream, c.data, c.offset) for c in chunks] == [
        ("stdout", b"ef", 4), ("stderr", b"yz", 4)]
