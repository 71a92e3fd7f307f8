"""One active copy of a service: hold its lease in KV while acting (`m27.common.leases`
has the rules and why they keep two copies from acting at once).

    standby: watch the key; take it (compare-and-set) when nobody holds it, or when its
             revision has not changed for ttl + margin
    active:  run `act`; renew every ttl/3 (compare-and-set); when a renewal loses to
             another copy, or none succeeded for ttl, cancel `act` and go back to standby
    stop:    cancel `act`, then give the lease up (no holder): a standby takes over at once

The acting code also asks `may_act()` before each effect: after a stall (SIGSTOP, a long
pause) its own callbacks may run before this loop notices the lease is gone. What a stalled
copy had already begun is fenced further down (the scheduler's attempt numbers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import nats.errors
import nats.js.errors

from m27.common import events, subjects
from m27.common.bus import Bus, NatsBus, T
from m27.common.errors import Unavailable
from m27.common.leases import (
    DEFAULT_MARGIN_S,
    DEFAULT_TTL_S,
    Lease,
    holder_may_act,
    standby_may_take,
    successor,
)
from m27.common.logging import get_logger

log = get_logger()

Ended = Literal["stopped", "deposed", "expired", "finished"]
_NATS_ERRORS: Final = (nats.errors.Error, TimeoutError, OSError)


class NotLeader(Unavailable):
    """This copy does not hold the lease (any more): what it was about to do is left to
    the active copy (a consumed message is redelivered to it)."""


class Leadership:
    """The lease of `service`; `run(act, stop)` acts while holding it."""

    def __init__(self, nats: NatsBus, service: str, instance: str, *,
                 ttl_s: float = DEFAULT_TTL_S, margin_s: float = DEFAULT_MARGIN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._nats = nats
        self.key = service
        self.holder = f"{instance}-{secrets.token_hex(4)}"
        self.ttl_s = ttl_s
        self.margin_s = margin_s
        self._clock = clock
        self._revision: int | None = None
        self._renew_started: float | None = None  # of the last renewal that succeeded
        self.token = 0
        self.elected = asyncio.Event()

    def may_act(self) -> bool:
        """Does this copy hold the lease right now (by its own clock)?"""
        return self._renew_started is not None and holder_may_act(
            self._renew_started, self._clock(), self.ttl_s)

    def check(self) -> None:
        """NotLeader unless `may_act()`."""
        if not self.may_act():
            raise NotLeader(f"this {self.key} copy ({self.holder}) is a standby")

    async def run(self, act: Callable[[], Coroutine[Any, Any, None]],
                  stop: asyncio.Event) -> None:
        """Act while holding the lease, until `stop` (or `act` fails: that error is
        raised, the lease given up first)."""
        while not stop.is_set():
            if not await self._acquire(stop):
                return
            log.info("leader.elected", service=self.key, holder=self.holder, token=self.token)
            acting = asyncio.create_task(act(), name=f"{self.key}-active")
            ended = await self._hold(acting, stop)
            self._renew_started = None
            self.elected.clear()
            await cancelled(acting)
            if ended in ("stopped", "finished"):
                await self._release()
                if ended == "finished" and not acting.cancelled():
                    failure = acting.exception()
                    if failure is not None:
                        raise failure
                return
            log.warning("leader.stepped_down", service=self.key, holder=self.holder,
                        token=self.token, why=ended)

    async def _acquire(self, stop: asyncio.Event) -> bool:
        """Wait as a standby until this copy holds the lease (False: stopped first)."""
        kv = await self._nats.kv(subjects.LEASES_BUCKET)
        seen: tuple[int, float] | None = None  # (revision, when first seen)
        waited = False
        while not stop.is_set():
            started = self._clock()
            try:
                entry = await kv.get(self.key)
                current = msgspec.json.decode(entry.value or b"null", type=Lease | None)
                revision = entry.revision or 0
            except nats.js.errors.KeyNotFoundError:
                current, revision = None, None
            except (*_NATS_ERRORS, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("leader.read_failed", service=self.key, error=str(exc))
                current, revision = None, -1
            if revision != -1:
                if revision is not None and (seen is None or seen[0] != revision):
                    seen = (revision, started)
                free = current is None or not current.holder or _died_here(current)
                stale = (seen is not None and current is not None and standby_may_take(
                    seen[1], self._clock(), max(current.ttl_s, self.ttl_s), self.margin_s))
                if (free or stale) and await self._take(kv, current, revision, started):
                    return True
            if not waited:
                log.info("leader.standby", service=self.key, holder=self.holder,
                         active=current.holder if current else None)
                waited = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.ttl_s / 4)
        return False

    async def _take(self, kv: object, current: Lease | None, revision: int | None,
                    started: float) -> bool:
        lease = successor(current, self.holder, self.ttl_s, time.time(),
                          this_host(), os.getpid())
        data = msgspec.json.encode(lease)
        try:
            if revision is None:
                new = await kv.create(self.key, data)  # type: ignore[attr-defined]
            else:
                new = await kv.update(self.key, data, last=revision)  # type: ignore[attr-defined]
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError,
                nats.js.errors.BadRequestError):
            return False  # another standby was quicker
        except _NATS_ERRORS as exc:
            log.warning("leader.take_failed", service=self.key, error=str(exc))
            return False
        self._revision, self._renew_started, self.token = new, started, lease.token
        self.elected.set()
        return True

    async def _hold(self, acting: asyncio.Task[None], stop: asyncio.Event) -> Ended:
        kv = await self._nats.kv(subjects.LEASES_BUCKET)
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while True:
                assert self._renew_started is not None
                deadline = self._renew_started + self.ttl_s
                wait = max(0.0, min(self.ttl_s / 3, deadline - self._clock()))
                await asyncio.wait({acting, stopping}, timeout=wait,
                                   return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set():
                    return "stopped"
                if acting.done():
                    return "finished"
                if not self.may_act():
                    return "expired"
                started = self._clock()
                lease = Lease(holder=self.holder, token=self.token, ttl_s=self.ttl_s,
                              renewed_at=time.time(), host=this_host(),
                              pid=os.getpid())
                try:
                    self._revision = await asyncio.wait_for(
                        kv.update(self.key, msgspec.json.encode(lease), last=self._revision),
                        timeout=max(0.1, deadline - self._clock()))
                    self._renew_started = started
                except nats.js.errors.KeyWrongLastSequenceError:
                    return "deposed"
                except _NATS_ERRORS as exc:
                    log.warning("leader.renew_failed", service=self.key, error=str(exc),
                                left_s=round(deadline - self._clock(), 1))
        finally:
            stopping.cancel()

    async def _release(self) -> None:
        """Give the lease up (only if still ours), so a standby need not wait it out: no
        holder, the token kept (tokens only grow)."""
        with contextlib.suppress(Exception):
            kv = await self._nats.kv(subjects.LEASES_BUCKET)
            free = Lease(holder="", token=self.token, ttl_s=self.ttl_s, renewed_at=time.time())
            await kv.update(self.key, msgspec.json.encode(free), last=self._revision)
            log.info("leader.released", service=self.key, holder=self.holder)


class FencedBus:
    """A bus whose every write first asks the lease (`Leadership.check`): what the acting
    code publishes or stores, it does only while this copy may act. Reads pass through."""

    def __init__(self, bus: Bus, leadership: Leadership) -> None:
        self._bus = bus
        self._leadership = leadership

    async def publish(self, subject: str, message: events.Message, *,
                      msg_id: str | None = None) -> None:
        self._leadership.check()
        await self._bus.publish(subject, message, msg_id=msg_id)

    async def publish_core(self, subject: str, message: events.Message) -> None:
        self._leadership.check()
        await self._bus.publish_core(subject, message)

    async def kv_get(self, bucket: str, key: str, type_: type[T]) -> tuple[T, int] | None:
        return await self._bus.kv_get(bucket, key, type_)

    async def kv_keys(self, bucket: str, pattern: str = ">") -> list[str]:
        return await self._bus.kv_keys(bucket, pattern)

    async def kv_put(self, bucket: str, key: str, value: msgspec.Struct) -> int:
        self._leadership.check()
        return await self._bus.kv_put(bucket, key, value)

    async def kv_update(self, bucket: str, key: str, type_: type[T],
                        change: Callable[[T | None], T | None], attempts: int = 20,
                        ttl_s: float | None = None) -> T | None:
        self._leadership.check()
        return await self._bus.kv_update(bucket, key, type_, change, attempts, ttl_s)

    async def kv_delete(self, bucket: str, key: str) -> None:
        self._leadership.check()
        await self._bus.kv_delete(bucket, key)

    async def kv_purge(self, bucket: str, key: str) -> None:
        self._leadership.check()
        await self._bus.kv_purge(bucket, key)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        return await self._bus.request(subject, data, timeout)


async def cancelled(task: asyncio.Task[Any], every_s: float = 1.0) -> None:
    """Cancel `task` and wait until it has ended, cancelling it again every `every_s`: on
    Python 3.11 a cancellation can be lost (asyncio.wait_for turns one that races its
    timeout into TimeoutError, and a loop that expects timeouts goes on), and a copy whose
    acting task never ended would never act again (found by the chaos suite: a scheduler
    stopped past its lease)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every_s)
    if not task.cancelled():
        task.exception()  # retrieved: the caller reads it if it wants it


@functools.cache
def this_host() -> str:
    """Where a pid means the same process: the host name, the machine's boot and the PID
    namespace. Two pods of one Deployment share a host name (`hostname:` in the manifest)
    and may share pids, but not a PID namespace; two machines do not share a boot id.
    Read once: none of them changes while the process runs."""
    parts = [socket.gethostname()]
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(source) if source.startswith("/proc/self/")
                         else Path(source).read_text().strip())
        except OSError:
            parts.append("?")
    return "|".join(parts)


def _died_here(lease: Lease) -> bool:
    """The holder ran in this PID namespace of this machine (`this_host`) and its process
    is gone (a crash, SIGKILL): no need to wait its lease out. A pid that was reused reads
    as alive: then it is waited out."""
    if (lease.host != this_host() or "?" in lease.host.split("|") or not lease.pid
            or lease.pid == os.getpid()):
        return False
    try:
        os.kill(lease.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    try:  # a zombie (killed, not yet reaped by its parent) is gone too
        stat = Path(f"/proc/{lease.pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]
