"""The notifier (part of the report service): events become notices (`notices`), rules and
chat subscriptions route them (`notifications.route`), channels deliver them (`channels`).

    receive an event (durable consumer `report-notify` on m27.events.>) → notices → route
      → for each place: claim it in m27_notified → send → mark sent → ack
    receive a GPU reading (`report-notify-telemetry`) → hot GPUs → the same
    every minute: queued tasks in m27_tasks waiting longer than [notify] waiting_after

Delivery is at least once and deduplicated: a place is claimed (compare-and-set) before
it is sent to and marked sent after, so a redelivered or repeated event, a restart or a
second notifier finds the mark and sends nothing. Only a crash between a send and its
mark, or a send whose outcome is unknown (a timeout after the request went out), can
repeat it, after a lease (CLAIM_LEASE_S); webhooks get the notice's id as
`Idempotency-Key` and e-mails as Message-ID so a receiver can drop that repeat too. A
failure that may pass leaves the event unacked: it comes back with a growing delay, and
places already served are skipped then; where the place certainly did not take the notice
(`channels.NotTaken`: down, 5xx, 429) the claim is freed at once, else it waits out its
lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Literal

import msgspec
from nats.aio.msg import Msg

from m27.common import bus, events, subjects
from m27.common.bus import Bus
from m27.common.config import NotifySection
from m27.common.errors import ConfigError, Unavailable
from m27.common.logging import get_logger
from m27.common.model import RunRecord
from m27.common.notifications import (
    ChannelKind,
    Delivery,
    Notice,
    Rule,
    Subscription,
    parse_rules,
    route,
    subscription_rules,
)
from m27.common.principals import sender_problem
from m27.report import notices
from m27.report.channels import Channel, NotTaken, Refused

log = get_logger()

#: A claim older than this whose sender never marked it is taken to have died: sent again.
CLAIM_LEASE_S: Final = 120.0
#: Chat subscriptions are re-read at most this often.
SUBSCRIPTIONS_TTL_S: Final = 2.0
WAITING_EVERY_S: Final = 60.0
MAX_SUBSCRIPTIONS: Final = 10_000

DeliveryState = Literal["sending", "sent", "refused"]


class Mark(msgspec.Struct, frozen=True, kw_only=True):
    """What m27_notified keeps of one notice at one place."""

    state: DeliveryState
    at: float
    notice: str
    place: str


class Busy(Unavailable):
    """Another notifier is sending this notice there right now."""


def mark_key(notice: Notice, delivery: Delivery) -> str:
    return hashlib.sha256(f"{notice.id}|{delivery.key}".encode()).hexdigest()[:40]


def default_rules(section: NotifySection) -> tuple[Rule, ...]:
    """`[notify] rules`, or (empty) the default kinds to every channel configured;
    ConfigError naming the rule that is wrong."""
    if section.rules.strip():
        try:
            return parse_rules(section.rules)
        except ValueError as exc:
            raise ConfigError(f"[notify] rules: {exc}") from exc
    text = []
    if section.webhook:
        text.append("-> webhook")
    if section.email_to and section.smtp_host:
        text.append("-> email")
    return parse_rules("\n".join(text))


def channel_defaults(section: NotifySection) -> dict[ChannelKind, tuple[str, ...]]:
    """Where a rule without a target sends, per channel."""
    return {"webhook": (section.webhook,) if section.webhook else (),
            "email": tuple(a.strip() for a in section.email_to.split(",") if a.strip()),
            "telegram": ()}


FetchRun = Callable[[str], Awaitable[RunRecord | None]]
Picture = Callable[[str], Awaitable[tuple[dict[str, float], bytes | None]]]


class Notifier:
    def __init__(self, nats: Bus, channels: dict[ChannelKind, Channel], *,
                 section: NotifySection, run_of: FetchRun, picture: Picture,
                 link: Callable[[str], str] = lambda run_id: "",
                 clock: Callable[[], float] = time.time) -> None:
        self._nats = nats
        self._channels = channels
        self._section = section
        self._rules = default_rules(section)
        self._defaults = channel_defaults(section)
        self._run_of = run_of
        self._picture = picture
        self._link = link
        self._clock = clock
        self._subscriptions: tuple[float, tuple[Rule, ...]] = (-1e18, ())
        self.sent = 0

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The configured rules (chats' subscriptions come on top)."""
        return self._rules

    async def close(self) -> None:
        for channel in self._channels.values():
            with contextlib.suppress(Exception):
                await channel.close()

    # ------------------------------------------------------------ consumers

    async def handle(self, msg: Msg) -> None:
        """The events consumer's handler."""
        event = bus.decode_or_poison(msg.data, events.decode_event)
        notice, image = await self._notice_of(msg.subject, event)
        if notice is not None:
            await self.notify(notice, image)

    async def handle_telemetry(self, msg: Msg) -> None:
        reading = bus.decode_or_poison(msg.data, events.decode_telemetry)
        if msg.subject != subjects.telemetry(subjects.node_sender(reading.node_id)):
            return  # the report's telemetry consumer dead-letters these; not ours to tell
        for notice in notices.hot_gpus(reading, self._section.gpu_hot_c):
            await self.notify(notice)

    async def watch_waiting(self, stop: asyncio.Event, every_s: float = WAITING_EVERY_S
                            ) -> None:
        """Tell about queued tasks waiting too long, every `every_s` until `stop`."""
        while not stop.is_set() and self._section.waiting_after > 0:
            try:
                await self.check_waiting()
            except Exception as exc:  # the bus away: try again next round
                log.warning("notify.waiting_check_failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    async def check_waiting(self) -> int:
        """One round of `watch_waiting`; how many notices it sent."""
        count = 0
        now = self._clock()
        for key in await self._nats.kv_keys(subjects.TASKS_BUCKET):
            got = await self._nats.kv_get(subjects.TASKS_BUCKET, key, _Queued)
            if got is None or got[0].placement is not None:
                continue
            entry = got[0]
            notice = notices.waiting(entry.task.task_id, entry.task.run_id, entry.task.user,
                                     entry.queued_at, now, self._section.waiting_after,
                                     entry.wait_reason)
            if notice is not None:
                try:
                    count += await self.notify(notice)
                except Unavailable as exc:
                    log.warning("notify.waiting_not_sent", error=str(exc))
        return count

    # ------------------------------------------------------------ events → notices

    async def _notice_of(self, subject: str, event: events.Event
                         ) -> tuple[Notice | None, bytes | None]:
        if isinstance(event, events.RunStateChanged):
            if notices.run_end_kind(event) is None:
                return None, None
            run = await self._run_of(event.run_id)
            if run is None:
                return None, None
            metrics, image = await self._picture(run.run_id)
            return notices.run_ended(event, run, metrics=metrics,
                                     link=self._link(run.run_id)), image
        if isinstance(event, events.TrainingAnomaly):
            if "notify" not in event.actions:
                return None, None
            fence = await bus.fence_of(self._nats, event.task_id)
            if sender_problem(subject, event, fence):
                return None, None  # forged; the report's task-events consumer buries it
            return notices.anomaly(event, await self._user_of(event.run_id)), None
        if isinstance(event, events.NodeLost):
            return notices.node_lost(event), None
        if isinstance(event, events.NodePlatformDiffers):
            return notices.node_platform(event), None
        if isinstance(event, events.NodeMaintenanceWindow):
            return notices.maintenance_window(event), None
        if isinstance(event, events.GpuMemoryLeak):
            if subject != subjects.node_events(event.node_id):
                return None, None
            run_id = event.task_id.partition("/")[0]
            return notices.memory_leak(event, run_id, await self._user_of(run_id)), None
        return None, None

    async def _user_of(self, run_id: str) -> str:
        run = await self._run_of(run_id) if run_id else None
        return run.user if run is not None else ""

    # ------------------------------------------------------------ routing and delivery

    async def notify(self, notice: Notice, image: bytes | None = None) -> int:
        """Deliver `notice` everywhere it is routed, each place once ever; how many sends
        this call made. Unavailable when a place could not be served now (after trying
        every other place)."""
        places = route(notice, (*self._rules, *await self._chat_rules()), self._defaults)
        sent, later = 0, []
        for delivery in places:
            try:
                sent += await self._deliver(notice, delivery, image)
            except Unavailable as exc:
                later.append(f"{delivery.channel}: {exc}")
        if later:
            raise Unavailable(f"notice {notice.kind} {notice.id[:12]} not delivered yet: "
                              + "; ".join(later))
        return sent

    async def _deliver(self, notice: Notice, delivery: Delivery, image: bytes | None) -> int:
        channel = self._channels.get(delivery.channel)
        if channel is None:
            log.warning("notify.no_channel", channel=delivery.channel, kind=notice.kind,
                        hint=f"configure the {delivery.channel} channel (docs/notifications.md)")
            return 0
        key = mark_key(notice, delivery)
        if not await self._claim(key, notice, delivery):
            return 0
        try:
            await channel.send(notice, delivery.target, image)
        except Refused as exc:
            log.error("notify.refused", channel=delivery.channel, kind=notice.kind,
                      run_id=notice.run_id, error=str(exc))
            await self._mark(key, notice, delivery, "refused")
            return 0
        except NotTaken:
            with contextlib.suppress(Exception):  # free the claim: the retry need not wait
                await self._nats.kv_delete(subjects.NOTIFIED_BUCKET, key)
            raise
        except Exception as exc:
            # It may have arrived: the claim stays, and the place hears of it again only
            # after the lease, when the retry takes the claim over.
            log.warning("notify.outcome_unknown", channel=delivery.channel, kind=notice.kind,
                        run_id=notice.run_id, notice=notice.id[:12], error=str(exc),
                        retry_after_s=CLAIM_LEASE_S)
            raise
        await self._mark(key, notice, delivery, "sent")
        self.sent += 1
        log.info("notify.sent", channel=delivery.channel, kind=notice.kind,
                 run_id=notice.run_id, notice=notice.id[:12])
        return 1

    async def _claim(self, key: str, notice: Notice, delivery: Delivery) -> bool:
        """Take the place for this notice; False when it was already served."""
        now = self._clock()
        claimed = False

        def change(current: Mark | None) -> Mark | None:
            nonlocal claimed
            claimed = False
            if current is not None:
                if current.state != "sending":
                    return None  # sent or refused: nothing to do
                if now - current.at < CLAIM_LEASE_S:
                    raise Busy(f"notice {notice.id[:12]} is being sent to "
                               f"{delivery.channel} by another notifier")
            claimed = True
            return Mark(state="sending", at=now, notice=notice.id, place=delivery.key)

        await self._nats.kv_update(subjects.NOTIFIED_BUCKET, key, Mark, change)
        return claimed

    async def _mark(self, key: str, notice: Notice, delivery: Delivery,
                    state: DeliveryState) -> None:
        await self._nats.kv_put(subjects.NOTIFIED_BUCKET, key, Mark(
            state=state, at=self._clock(), notice=notice.id, place=delivery.key))

    async def _chat_rules(self) -> tuple[Rule, ...]:
        """The chats' subscriptions as rules, re-read at most every SUBSCRIPTIONS_TTL_S."""
        read_at, rules = self._subscriptions
        if time.monotonic() - read_at < SUBSCRIPTIONS_TTL_S:
            return rules
        found: list[Subscription] = []
        for key in (await self._nats.kv_keys(subjects.SUBSCRIPTIONS_BUCKET))[:MAX_SUBSCRIPTIONS]:
            try:
                got = await self._nats.kv_get(subjects.SUBSCRIPTIONS_BUCKET, key, Subscription)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("notify.bad_subscription", key=key, error=str(exc))
                continue
            if got is not None:
                found.append(got[0])
        rules = subscription_rules(found)
        self._subscriptions = (time.monotonic(), rules)
        return rules


class _QueuedTask(msgspec.Struct, frozen=True):
    task_id: str
    run_id: str
    user: str = ""


class _Queued(msgspec.Struct, frozen=True):
    """What the notifier reads of a scheduler's task entry (m27_tasks)."""

    task: _QueuedTask
    queued_at: float
    placement: dict[str, object] | None = None
    wait_reason: str = ""


def describe_rules(rules: Sequence[Rule]) -> list[str]:
    """The rules as one line each, for the start-up log (a webhook's URL left out: it
    often holds a secret)."""
    return [f"{' '.join(r.kinds)} -> {r.channel}"
            + (f":{r.target}" if r.target and r.channel != "webhook" else "")
            + (f" users={','.join(r.users)}" if r.users else "")
            + (f" runs={','.join(r.runs)}" if r.runs else "") for r in rules]
