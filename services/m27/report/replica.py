"""Every copy of the report service is a whole replica: it reads each stream it
materialises (metrics, telemetry, task events, run states) itself, from the position its
own history store holds, with the paged ordered consumers of `m27.common.stream_pages`.

No durable consumer is shared, so two copies (a rolling update, `replicas: 2`) each hold
the whole history, answer every query and write every report; neither takes a message
from the other, and either may die at any moment. A message's effect and the position
after it are written in one SQLite transaction (`store.History`, `applied`), so a copy
that is killed resumes exactly where its store is; a report file is written before its
position is stored, so one killed in between writes that report again (same file, same
`ReportReady` message id).

A handler's failure is treated as `bus.consume` treats it: a refused message
(`PoisonMessage`) is logged and passed; a failure that may pass (NATS or the API away) is
tried again after a growing pause, for ever; any other failure is tried
`bus.MAX_FAILED_DELIVERIES` times, then logged and passed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from m27.common import bus
from m27.common.logging import get_logger
from m27.common.stream_pages import StartAt, StreamPages
from m27.report.store import Applied, History

log = get_logger()

#: How long a reader waits for a message before it stores the position of messages it
#: passed (no effect) and looks at `stop` again.
IDLE_S: Final = 0.5
#: ... or after this many such messages in a row (a stream that is never idle).
MARK_EVERY: Final = 1000
RECONNECT_S: Final = 1.0

#: Applies one message with its position (`History.add_*(…, applied)`); False when the
#: message had no effect to store (its position is stored later, with `History.mark`).
Handler = Callable[[Msg, Applied], Awaitable[bool]]


@dataclass(frozen=True)
class Source:
    """A stream (or part of one) a replica materialises; `name` keys its position."""

    name: str
    stream: str
    filters: tuple[str, ...]


class Progress:
    """How far each source has been read in this process (the next stream sequence)."""

    def __init__(self) -> None:
        self.next: dict[str, int] = {}

    def advance(self, source: str, sequence: int) -> None:
        self.next[source] = sequence + 1


async def follow(js: JetStreamContext, history: History, source: Source, handle: Handler,
                 stop: asyncio.Event, progress: Progress | None = None) -> None:
    """Read `source` from the stored position until `stop`, applying each message once."""
    start = await _start(js, history, source)
    pages = StreamPages(js, source.stream, source.filters,
                        StartAt(policy="sequence", sequence=start))
    if progress is not None:
        progress.advance(source.name, start - 1)
    passed: Applied | None = None  # the last message with no effect, not yet stored
    unmarked = 0
    log.info("report.reading", source=source.name, stream=source.stream, start=start)
    try:
        while not stop.is_set():
            try:
                msg = await pages.next(IDLE_S)
            except (nats.errors.Error, TimeoutError) as exc:  # NATS away: ask again
                log.warning("report.read_failed", source=source.name,
                            error=str(exc) or type(exc).__name__)
                await _pause(stop, RECONNECT_S)
                continue
            if msg is None or unmarked >= MARK_EVERY:
                if passed is not None:
                    await asyncio.to_thread(history.mark, passed)
                passed, unmarked = None, 0
                if msg is None:
                    continue
            applied = (source.name, msg.metadata.sequence.stream)
            stored = await _apply(msg, applied, handle, stop)
            if stored is None:
                return  # stopped while retrying: read again from this message next time
            passed = None if stored else applied
            unmarked = 0 if stored else unmarked + 1
            if progress is not None:
                progress.advance(*applied)
    finally:
        if passed is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(history.mark, passed)
        await pages.close()


async def _start(js: JetStreamContext, history: History, source: Source) -> int:
    """The stored position; the stream's start when that lies past the stream's end (the
    bus was made anew while this store was kept: its sequences began again at 1)."""
    start = await asyncio.to_thread(history.position, source.name)
    try:
        state = (await js.stream_info(source.stream)).state
    except (nats.errors.Error, TimeoutError):
        return start  # NATS away: the stored position stands (the reader waits for it)
    if start <= state.last_seq + 1:
        return start
    log.warning("report.position_beyond_stream", source=source.name, stream=source.stream,
                position=start, last_sequence=state.last_seq)
    await asyncio.to_thread(history.forget_position, source.name)
    return max(1, state.first_seq)


async def _apply(msg: Msg, applied: Applied, handle: Handler,
                 stop: asyncio.Event) -> bool | None:
    """True or False as `handle` says (False also for a message passed over); None when
    `stop` came while it was being retried."""
    failures = 0
    while not stop.is_set():
        try:
            return await handle(msg, applied)
        except bus.PoisonMessage as exc:
            log.error("report.message_refused", source=applied[0], sequence=applied[1],
                      subject=msg.subject, error=str(exc))
            return False
        except Exception as exc:
            failures += 1
            if not bus.transient(exc) and failures >= bus.MAX_FAILED_DELIVERIES:
                log.exception("report.message_passed", source=applied[0],
                              sequence=applied[1], subject=msg.subject, error=str(exc),
                              failures=failures)
                return False
            log.exception("bus.handler_failed", source=applied[0], sequence=applied[1],
                          subject=msg.subject, error=str(exc), failures=failures)
            await _pause(stop, bus.retry_delay(failures))
    return None


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
