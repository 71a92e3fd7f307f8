"""Masks a step's secret values in its output on the way to the log files (stdlib only).

The node-agent starts one masker per step (`python -S <this file> --pipe IN_FD:OUT_FD …`,
the fds passed with `pass_fds`, the values in `M27_MASK_VALUES` as a JSON list of strings).
Each IN_FD is the read end of a pipe the step writes its stdout or stderr to; each OUT_FD
is the opened log file. The agent closes its own copies of both ends once the masker runs:
the masker exits when every input reached EOF, that is when every writer closed.

Data is copied as soon as it arrives, never waiting for a newline (progress bars that
redraw with `\\r` keep flowing). Only the shortest tail that could still become a secret
with the next read is held back, so a secret split across two reads is masked and nothing
else is delayed (`Masker`). Values shorter than `MIN_MASKED` bytes are not masked (masking
"1" would destroy ordinary logs); a value with newlines is also masked line by line, and a
value longer than `MAX_MASKED` bytes only line by line.

The masker must outlive anything that happens around it: it ignores the usual signals, and
if writing a log file fails (disk full, EIO) it says so once on its own stderr and keeps
reading and discarding that input, so the step never blocks on a full pipe; it then exits
`EXIT_OUTPUT_FAILED` instead of 0. A missing or malformed `M27_MASK_VALUES` (or bad fds)
exits `EXIT_USAGE` before anything is read: copying secrets unmasked is never the fallback.

It imports nothing from m27 (and nothing outside the standard library): it starts in
milliseconds and keeps working whatever the agent's process is doing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import selectors
import signal
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Final

MIN_MASKED: Final = 4
MAX_MASKED: Final = 4096
MASK: Final = b"***"
BLOCK: Final = 64 * 1024
VALUES_ENV: Final = "M27_MASK_VALUES"
SCRIPT: Final = os.path.abspath(__file__)
EXIT_OUTPUT_FAILED: Final = 1
EXIT_USAGE: Final = 2
# Everything that could end the masker early; SIGPIPE and SIGXFSZ turn into write errors.
IGNORED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                          signal.SIGUSR2, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTTOU)


def _utf8(text: str) -> bytes:
    # surrogateescape gives back the bytes of a non-UTF-8 value read from an environment.
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def patterns(values: Sequence[str]) -> tuple[bytes, ...]:
    """The byte strings to mask for `values`, deduplicated, longest first."""
    found: set[bytes] = set()
    for value in values:
        candidates = [value]
        if "\n" in value:
            candidates += [line.rstrip("\r").strip() for line in value.split("\n")]
        found.update(b for b in map(_utf8, candidates) if MIN_MASKED <= len(b) <= MAX_MASKED)
    return tuple(sorted(found, key=lambda b: (-len(b), b)))


class Masker:
    """Masks one stream fed in pieces exactly as if it had been masked in one piece.

    At each position the longest pattern that matches wins; scanning resumes after it. A
    tail is held back only while a pattern could still start in it."""

    def __init__(self, values: Sequence[str]) -> None:
        self._patterns = patterns(values)
        self._regex: re.Pattern[bytes] | None = (
            re.compile(b"|".join(map(re.escape, self._patterns))) if self._patterns else None)
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        """What can be written now that `data` arrived."""
        if self._regex is None:
            return data
        buf = self._pending + data if self._pending else data
        parts: list[bytes] = []
        done = 0
        partial = self._first_partial(buf, 0)
        for match in self._regex.finditer(buf):
            start, end = match.span()
            if partial is not None and partial <= start:
                break  # a match that could still start at `partial` (or be longer) wins
            parts += (buf[done:start], MASK)
            done = end
            if partial is not None and partial < done:
                partial = self._first_partial(buf, done)
        hold = len(buf) if partial is None else partial
        parts.append(buf[done:hold])
        self._pending = buf[hold:]
        return b"".join(parts)

    def flush(self) -> bytes:
        """The rest, once the stream ended."""
        rest, self._pending = self._pending, b""
        return rest if self._regex is None else self._regex.sub(MASK, rest)

    def _first_partial(self, buf: bytes, lo: int) -> int | None:
        """The first position >= `lo` whose suffix of `buf` is a proper prefix of a pattern:
        the start of the longest tail to hold back. Only the last len(pattern) - 1 bytes can
        hold one, and only where the pattern's first byte occurs."""
        size = len(buf)
        best = size
        for pattern in self._patterns:
            first = pattern[0]
            at = buf.find(first, max(lo, size - len(pattern) + 1), best)
            while at != -1:
                if pattern.startswith(buf[at:]):
                    best = at
                    break
                at = buf.find(first, at + 1, best)
        return best if best < size else None


# ---------------------------------------------------------------- the process


def say(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with contextlib.suppress(OSError, ValueError):  # a closed stderr must not stop the copy
        print(json.dumps({"timestamp": stamp, "service": "log-mask", "event": message}),
              file=sys.stderr, flush=True)


def load_values(environ: Mapping[str, str]) -> list[str]:
    """The values to mask, from `M27_MASK_VALUES`; ValueError says what is wrong."""
    raw = environ.get(VALUES_ENV)
    if raw is None:
        raise ValueError(f"{VALUES_ENV} is not set")
    try:
        values = json.loads(raw)
    except ValueError:
        raise ValueError(f"{VALUES_ENV} is not valid JSON") from None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{VALUES_ENV} is not a JSON list of strings")
    return values


def parse_pipe(text: str) -> tuple[int, int]:
    in_text, sep, out_text = text.partition(":")
    try:
        in_fd, out_fd = int(in_text), int(out_text)
    except ValueError:
        in_fd = out_fd = -1
    if not sep or in_fd < 0 or out_fd < 0:
        raise argparse.ArgumentTypeError(f"expected IN_FD:OUT_FD, got {text!r}")
    return in_fd, out_fd


def check_fds(pipes: Sequence[tuple[int, int]]) -> None:
    """ValueError unless every fd is open, and every input is a pipe named once."""
    inputs = [in_fd for in_fd, _ in pipes]
    if len(set(inputs)) != len(inputs):
        raise ValueError("an input fd is named twice")
    for fd in sorted({fd for pipe in pipes for fd in pipe}):
        try:
            mode = os.fstat(fd).st_mode
            os.set_blocking(fd, True)
        except OSError as exc:
            raise ValueError(f"fd {fd} is not usable: {exc.strerror}") from None
        if fd in inputs and not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            raise ValueError(f"input fd {fd} is not a pipe")


class _Stream:
    __slots__ = ("in_fd", "masker", "out_fd")  # not a dataclass: that import costs 10 ms

    def __init__(self, in_fd: int, out_fd: int, masker: Masker) -> None:
        self.in_fd, self.out_fd, self.masker = in_fd, out_fd, masker


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Outputs:
    """Writes to the log files; one that failed is skipped from then on."""

    def __init__(self) -> None:
        self.failed: set[int] = set()

    def write(self, fd: int, data: bytes) -> None:
        if not data or fd in self.failed:
            return
        try:
            _write_all(fd, data)
        except OSError as exc:
            self.failed.add(fd)
            say(f"writing to fd {fd} failed ({exc.strerror}): its input is read and discarded")


def serve(pipes: Sequence[tuple[int, int]], values: Sequence[str]) -> int:
    """Copy every input to its output, masked, until all inputs reached EOF."""
    outputs = _Outputs()
    with selectors.DefaultSelector() as selector:
        for in_fd, out_fd in pipes:
            selector.register(in_fd, selectors.EVENT_READ, _Stream(in_fd, out_fd, Masker(values)))
        while selector.get_map():
            for key, _ in selector.select():
                stream: _Stream = key.data
                try:
                    chunk = os.read(stream.in_fd, BLOCK)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    say(f"reading fd {stream.in_fd} failed ({exc.strerror}): taken as its end")
                    chunk = b""
                if chunk:
                    outputs.write(stream.out_fd, stream.masker.feed(chunk))
                    continue
                outputs.write(stream.out_fd, stream.masker.flush())
                selector.unregister(stream.in_fd)
                os.close(stream.in_fd)
    return EXIT_OUTPUT_FAILED if outputs.failed else 0


def main(argv: Sequence[str] | None = None) -> None:
    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipe", type=parse_pipe, action="append", required=True,
                        metavar="IN_FD:OUT_FD", help="copy IN_FD to OUT_FD, masked")
    args = parser.parse_args(argv)
    try:
        values = load_values(os.environ)
        check_fds(args.pipe)
    except ValueError as exc:
        say(f"{exc}: nothing is copied")
        raise SystemExit(EXIT_USAGE) from None
    raise SystemExit(serve(args.pipe, values))


if __name__ == "__main__":
    main()
