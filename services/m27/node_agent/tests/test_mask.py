"""The masker: secret values never reach a step's log files, whatever the pieces the output
arrives in, and the masker process outlives signals, full disks and closed writers."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.node_agent._mask import MAX_MASKED, SCRIPT, Masker, patterns

SECRET = "hunter2-s3cr3t"  # noqa: S105 - a made-up value to mask
WAIT_S = 10.0


def reference(values: Sequence[str], data: bytes) -> bytes:
    """Masking in one piece, the slow obvious way: at each position the longest pattern."""
    pats = sorted(patterns(values), key=len, reverse=True)
    out, at = bytearray(), 0
    while at < len(data):
        hit = next((p for p in pats if data.startswith(p, at)), None)
        if hit is None:
            out.append(data[at])
            at += 1
        else:
            out += b"***"
            at += len(hit)
    return bytes(out)


def masked_in_pieces(values: Sequence[str], chunks: Sequence[bytes]) -> bytes:
    masker = Masker(values)
    return b"".join(masker.feed(c) for c in chunks) + masker.flush()


# ---------------------------------------------------------------- the pure core

# Small alphabets so secrets overlap, prefix each other and appear by chance; plus any text.
LETTERS = st.sampled_from(list("ab*\n\r é€😀"))
TEXTS = st.text(LETTERS | st.characters(codec="utf-8"), max_size=50) | st.text("ab", max_size=9)


@st.composite
def secrets(draw: st.DrawFn) -> list[str]:
    """Up to 4 values, some of them with a prefix of theirs as one more value."""
    values = draw(st.lists(TEXTS, max_size=4))
    return values + [v[:draw(st.integers(0, len(v)))] for v in values if draw(st.booleans())]


@st.composite
def output_with(draw: st.DrawFn, secrets: list[str]) -> tuple[bytes, list[bytes]]:
    """Output bytes holding the secrets (and pieces of them) at random places, and a random
    split of it into chunks."""
    pieces = st.binary(max_size=20) | st.text(LETTERS, max_size=8).map(str.encode)
    if secrets:
        encoded = [s.encode() for s in secrets]
        pieces |= st.sampled_from(encoded)
        pieces |= st.tuples(st.sampled_from(encoded), st.integers(0, 60)).map(
            lambda sn: sn[0][:sn[1]])
    data = b"".join(draw(st.lists(pieces, max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    return data, [data[a:b] for a, b in pairwise(bounds)]


@given(st.data(), secrets())
def test_masking_in_pieces_equals_masking_in_one_piece(data: st.DataObject,
                                                       secrets: list[str]) -> None:
    output, chunks = data.draw(output_with(secrets))
    result = masked_in_pieces(secrets, chunks)
    assert result == reference(secrets, output)
    assert masked_in_pieces(secrets, [output[i:i + 1] for i in range(len(output))]) == result
    for pattern in patterns(secrets):
        if b"*" not in pattern:
            assert pattern not in result


def test_a_tail_that_starts_no_secret_is_returned_at_once() -> None:
    masker = Masker([SECRET])
    assert masker.feed(b"loss 0.25\r") == b"loss 0.25\r"
    assert masker.feed(b"hun") == b""  # could be the secret: held back
    assert masker.feed(b"gry\r") == b"hungry\r"
    assert masker.feed(b"x hunter2-s3") == b"x "  # only the tail that starts the secret
    assert masker.feed(b"cr3t!") == b"***!"
    assert masker.flush() == b""


def test_the_held_tail_is_the_longest_one_that_could_become_a_secret() -> None:
    masker = Masker(["abcabd", "bcxy"])
    assert masker.feed(b"zzabcab") == b"zz"
    assert masker.feed(b"c") == b"abc"  # "abcabc": "abc" can still start the first one
    assert masker.flush() == b"abc"


def test_a_match_that_a_longer_or_earlier_one_may_still_replace_is_held() -> None:
    masker = Masker(["abcdefgh", "cdef", "defghijk"])
    assert masker.feed(b"..abcdef") == b".."  # "abcdefgh" may still come
    assert masker.feed(b"gh") == b"***"
    masker = Masker(["abcd", "bcdefg"])
    assert masker.feed(b"bcdab") == b"bcd"
    assert masker.feed(b"cd") == b"***"
    masker = Masker(["abcdef", "abcd"])
    assert masker.feed(b"abcde") == b""  # "abcd" matched, but "abcdef" may still come
    assert masker.feed(b"f") == b"***"


def test_nothing_to_mask_passes_data_through() -> None:
    masker = Masker(["", "abc", "x"])
    data = b"abc x \r\n"
    assert masker.feed(data) is data
    assert masker.flush() == b""


@pytest.mark.parametrize(("values", "expected"), [
    (["abc", "1", ""], ()),  # under MIN_MASKED bytes: ordinary logs stay readable
    (["é€"], ("é€".encode(),)),  # bytes count, not characters: 5 bytes
    (["abcd", "abcd", "abcdef"], (b"abcdef", b"abcd")),
    (["line-one\r\n  line-two  \nab\n"], (b"line-one\r\n  line-two  \nab\n", b"line-one",
                                          b"line-two")),
    (["x" * (MAX_MASKED + 1)], ()),
    (["x" * (MAX_MASKED - 2) + "\nline"], (b"x" * (MAX_MASKED - 2), b"line")),  # by line only
])
def test_patterns(values: list[str], expected: tuple[bytes, ...]) -> None:
    assert patterns(values) == expected


def test_short_values_are_kept_and_multi_line_values_are_masked_line_by_line() -> None:
    key = "-----BEGIN KEY-----\nMIIEvQIBADANBg\n-----END KEY-----\n"
    masker = Masker(["42", key])
    out = masker.feed(b"step 42\n" + key.encode() + b"again: MIIEvQIBADANBg\n") + masker.flush()
    assert out == b"step 42\n***again: ***\n"


def test_long_secrets_and_many_patterns_stay_fast() -> None:
    secrets = [f"{i:02d}" + "a" * (MAX_MASKED - 2) for i in range(50)]
    masker = Masker(secrets)
    data = (b"a" * 70_000 + secrets[7].encode() + b"tail") * 8
    started = time.monotonic()
    out = b"".join(masker.feed(data[i:i + 65_536]) for i in range(0, len(data), 65_536))
    out += masker.flush()
    assert out == (b"a" * 70_000 + b"***tail") * 8
    assert time.monotonic() - started < 5  # quadratic per call would take minutes


# ---------------------------------------------------------------- the process


class Running:
    """A masker process and the write ends of its input pipes."""

    def __init__(self, proc: subprocess.Popen[bytes], writers: list[int]) -> None:
        self.proc, self.writers = proc, writers

    def write(self, index: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.writers[index], view):]

    def close_inputs(self) -> None:
        for fd in self.writers:
            os.close(fd)
        self.writers = []

    def finish(self) -> tuple[int, str]:
        self.close_inputs()
        _, err = self.proc.communicate(timeout=WAIT_S)
        return self.proc.returncode, err.decode()


def wait_for(fact: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not fact():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@contextmanager
def masker(outputs: Sequence[Path | str],
           raw_values: str | None = json.dumps([SECRET])) -> Iterator[Running]:
    """Start the masker on one pipe per output; `raw_values` is M27_MASK_VALUES, or unset."""
    env = {k: v for k, v in os.environ.items() if k != "M27_MASK_VALUES"}
    if raw_values is not None:
        env["M27_MASK_VALUES"] = raw_values
    pipes = [os.pipe() for _ in outputs]
    outs = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) for path in outputs]
    argv = [sys.executable, "-S", SCRIPT]
    for (reader, _), out in zip(pipes, outs, strict=True):
        argv += ["--pipe", f"{reader}:{out}"]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            pass_fds=[fd for (r, _), o in zip(pipes, outs, strict=True)
                                      for fd in (r, o)])
    for (reader, _), out in zip(pipes, outs, strict=True):
        os.close(reader)
        os.close(out)
    running = Running(proc, [w for _, w in pipes])
    try:
        yield running
    finally:
        running.close_inputs()
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT_S)


def test_the_process_masks_each_pipe_as_data_arrives(tmp_path: Path) -> None:
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with masker([out, err]) as running:
        running.write(0, b"epoch 1 10%\rhunter")  # no newline, and half a secret
        wait_for(lambda: out.read_bytes() == b"epoch 1 10%\r")
        running.write(1, b"token=hunter2-")
        running.write(0, b"2-s3cr3t 20%\r")
        running.write(1, b"s3cr3t\n")
        running.write(0, b"done hunter2-s3")  # a prefix at EOF is written as it is
        code, messages = running.finish()
    assert code == 0, messages
    assert out.read_bytes() == b"epoch 1 10%\r*** 20%\rdone hunter2-s3"
    assert err.read_bytes() == b"token=***\n"


def test_the_process_ignores_signals_and_finishes_its_copy(tmp_path: Path) -> None:
    out = tmp_path / "out.log"
    with masker([out]) as running:
        running.write(0, b"started\n")
        wait_for(lambda: out.read_bytes() == b"started\n")
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                       signal.SIGUSR2):
            running.proc.send_signal(signum)
        running.write(0, f"still {SECRET}\n".encode())
        code, messages = running.finish()
    assert code == 0, messages
    assert out.read_bytes() == b"started\nstill ***\n"


@pytest.mark.parametrize(("raw", "message"), [
    (None, "M27_MASK_VALUES is not set"),
    ("[not json", "M27_MASK_VALUES is not valid JSON"),
    ('{"a": "secret"}', "M27_MASK_VALUES is not a JSON list of strings"),
    ('["fine", 42]', "M27_MASK_VALUES is not a JSON list of strings"),
])
def test_bad_values_exit_2_before_copying_anything(tmp_path: Path, raw: str | None,
                                                   message: str) -> None:
    out = tmp_path / "out.log"
    with masker([out], raw_values=raw) as running:
        code, messages = running.finish()
    assert code == 2
    assert message in messages
    assert out.read_bytes() == b""


def test_a_failing_output_is_drained_so_the_step_never_blocks() -> None:
    with masker(["/dev/full"]) as running:
        writer = running.writers[0]
        os.set_blocking(writer, False)
        block, left = f"{SECRET}\n".encode() * 4096, 2 * 1024 * 1024  # far more than a pipe holds
        deadline = time.monotonic() + WAIT_S
        while left:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the masker stopped reading"
            _, ready, _ = select.select([], [writer], [], remaining)
            with suppress(BlockingIOError):
                left -= os.write(writer, block[:left]) if ready else 0
        code, messages = running.finish()
    assert code == 1  # every input reached its end, but a log file is incomplete
    lines = messages.splitlines()
    assert len(lines) == 1
    assert "No space left on device" in lines[0]
    assert SECRET not in messages
