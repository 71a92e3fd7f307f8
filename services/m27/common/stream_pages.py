"""Reading a stream in order from a given point, a page of messages at a time, without a
durable consumer: what `WatchEvents` feeds and the report's replicas read with.

A push consumer sends as fast as JetStream's flow control lets it (its window grows to
32 MiB outstanding), so a reader that goes slowly would make that much pile up here. So
each page is an ephemeral ordered consumer whose subscription the server ends after
`PAGE` messages (an auto-unsubscribe): at most a page waits in this process, however
slow the reader, and the next page is a new consumer that starts after the last message
taken. Consumers are never named and never deleted by hand (the bus permissions allow
neither): one expires `INACTIVE_S` after its subscription went away — a page turned, the
reader left, or this process died. Any number of readers may read one stream this way,
each from its own point: none takes a message from another.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Literal

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

#: Messages (control messages included) one page's subscription takes.
PAGE: Final = 512
INACTIVE_S: Final = 2.0
#: How long `next` waits by default for a message before saying none came (and checking
#: that the consumer still exists: a NATS server that restarted has forgotten it).
IDLE_S: Final = 5.0


@dataclass(frozen=True)
class StartAt:
    """Where reading starts: at a stream sequence (`sequence`; 1 is the beginning), at a
    time (`time`, seconds since the epoch), or with the messages that come after now."""

    policy: Literal["sequence", "time", "new"]
    sequence: int = 1
    time: float = 0.0


class StreamPages:
    """The messages of `stream` matching `filters` in stream order, across pages."""

    def __init__(self, js: JetStreamContext, stream: str, filters: tuple[str, ...],
                 start: StartAt) -> None:
        if not filters:
            raise ValueError("a stream reader needs at least one filter subject")
        self._js = js
        self._stream = stream
        self._filters = filters
        self._start = start
        self._sub: JetStreamContext.PushSubscription | None = None
        self._taken = 0

    async def open(self) -> bool:
        """Subscribe the first page; True when it has nothing at all to send (yet)."""
        sub = await self._page()
        info = await sub.consumer_info()
        sent = info.delivered.consumer_seq if info.delivered else 0
        return not info.num_pending and not sent

    async def next(self, idle_s: float = IDLE_S) -> Msg | None:
        """The next message, or None when none came for `idle_s` from a live consumer."""
        while True:
            sub = self._sub or await self._page()
            if self._page_over(sub):
                sub = await self._page()
            try:
                msg = await sub.next_msg(timeout=idle_s)
            except nats.errors.TimeoutError:
                if self._page_over(sub) or not await self._alive(sub):
                    await self._page()
                    continue
                return None
            break
        self._taken += 1
        self._start = StartAt(policy="sequence", sequence=msg.metadata.sequence.stream + 1)
        return msg

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None

    async def _page(self) -> JetStreamContext.PushSubscription:
        """A new consumer from where the reader is, its subscription limited to a page."""
        await self.close()
        config = ConsumerConfig(filter_subjects=list(self._filters)
                                if len(self._filters) > 1 else None)
        if self._start.policy == "sequence":
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = max(1, self._start.sequence)
        elif self._start.policy == "time":
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = datetime.fromtimestamp(self._start.time, tz=UTC)
        else:
            config.deliver_policy = DeliverPolicy.NEW
        # a single filter is the subscription's subject
        self._sub = await self._js.subscribe(
            self._filters[0], stream=self._stream, ordered_consumer=True, config=config,
            inactive_threshold=INACTIVE_S)
        await self._sub.unsubscribe(limit=PAGE)  # the server's side; the rest stays
        self._taken = 0
        return self._sub

    def _page_over(self, sub: JetStreamContext.PushSubscription) -> bool:
        """A page's messages are taken, or the server ended its subscription (control
        messages count too) and nothing of it waits here."""
        return self._taken >= PAGE or (sub.delivered >= PAGE and not sub.pending_msgs)

    @staticmethod
    async def _alive(sub: JetStreamContext.PushSubscription) -> bool:
        try:
            await sub.consumer_info()
        except nats.js.errors.NotFoundError:
            return False
        except (nats.errors.Error, TimeoutError):
            return True  # NATS is away: the next idle check asks again
        return True
