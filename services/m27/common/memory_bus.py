"""`MemoryBus`: the in-memory `m27.common.bus.Bus` for unit tests of a service's core.

It keeps what a test needs to assert on: every publish in order (subject, message, msg_id),
and KV buckets with revisions and compare-and-set, as JetStream KV does. Values are stored
as their JSON bytes, so a test reads back exactly what the real bucket would hold.
`fail_with` makes every call raise (NATS away), to test outboxes and retries.

Integration tests never use it: they run a real nats-server (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import nats.errors

from m27.common import events
from m27.common.errors import BusError

T = TypeVar("T")


def subject_matches(pattern: str, key: str) -> bool:
    """NATS wildcard matching over `.`-separated tokens: `*` is one token, `>` the rest."""
    want, have = pattern.split("."), key.split(".")
    for index, part in enumerate(want):
        if part == ">":
            return len(have) > index
        if index >= len(have) or part not in ("*", have[index]):
            return False
    return len(want) == len(have)


class MemoryBus:
    """Publishes recorded, KV kept in a dict; no streams, no consumers, no network."""

    def __init__(self) -> None:
        self.published: list[tuple[str, events.Message, str | None]] = []
        self.core: list[tuple[str, events.Message]] = []
        self.kv: dict[tuple[str, str], tuple[bytes, int]] = {}
        #: (bucket, key) → the TTL its value was written with (NATS would remove it then)
        self.expiring: dict[tuple[str, str], float] = {}
        self.fail_with: Exception | None = None
        self.requests: list[tuple[str, bytes]] = []
        #: Answers `request` (None: nobody answers).
        self.responder: Callable[[str, bytes], Awaitable[bytes]] | None = None
        self._revision = 0

    def _check(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with

    # ------------------------------------------------------------------ the Bus protocol

    async def publish(self, subject: str, message: events.Message, *,
                      msg_id: str | None = None) -> None:
        self._check()
        self.published.append((subject, message, msg_id))

    async def publish_core(self, subject: str, message: events.Message) -> None:
        self._check()
        self.core.append((subject, message))

    async def kv_get(self, bucket: str, key: str, type_: type[T]) -> tuple[T, int] | None:
        self._check()
        stored = self.kv.get((bucket, key))
        if stored is None:
            return None
        return msgspec.json.decode(stored[0], type=type_), stored[1]

    async def kv_keys(self, bucket: str, pattern: str = ">") -> list[str]:
        self._check()
        return sorted(key for b, key in self.kv if b == bucket and subject_matches(pattern, key))

    async def kv_put(self, bucket: str, key: str, value: msgspec.Struct) -> int:
        self._check()
        self._revision += 1
        self.kv[(bucket, key)] = (msgspec.json.encode(value), self._revision)
        self.expiring.pop((bucket, key), None)
        return self._revision

    async def kv_update(self, bucket: str, key: str, type_: type[T],
                        change: Callable[[T | None], T | None], attempts: int = 20,
                        ttl_s: float | None = None) -> T | None:
        self._check()
        if attempts < 1:
            raise BusError(f"{bucket}/{key}: too many concurrent updates")
        got = await self.kv_get(bucket, key, type_)
        current = got[0] if got else None
        new = change(current)
        if new is None:
            return current
        self._revision += 1
        self.kv[(bucket, key)] = (msgspec.json.encode(new), self._revision)
        if ttl_s is None:
            self.expiring.pop((bucket, key), None)
        else:
            self.expiring[(bucket, key)] = ttl_s
        return new

    async def kv_delete(self, bucket: str, key: str) -> None:
        self._check()
        self.kv.pop((bucket, key), None)
        self.expiring.pop((bucket, key), None)

    async def kv_purge(self, bucket: str, key: str) -> None:
        await self.kv_delete(bucket, key)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        self._check()
        self.requests.append((subject, data))
        if self.responder is None:
            raise nats.errors.NoRespondersError
        return await self.responder(subject, data)

    # ------------------------------------------------------------------ for assertions

    def kinds(self) -> list[str]:
        """The tag of every stored publish, in order (`start_task`, `task_placed`, …)."""
        return [events.tag_of(message) for _, message, _ in self.published]

    def of(self, kind: type[T]) -> list[T]:
        """The stored publishes of one message type, in order."""
        return [message for _, message, _ in self.published if isinstance(message, kind)]
