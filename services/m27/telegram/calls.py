"""The bot's calls to the m27 APIs, each as the m27 user a chat is allowed as.

Every call carries a token the bot signs for that user with the role `user` (the bot holds
the control-plane key, as the other control-plane services do), so the orchestrator and
the scheduler apply that user's level, priority and ownership checks: a chat can never
act as anyone else. Addresses come from the services bucket (the newest instance of each
service), or `--api` for the orchestrator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Final

from m27.client import Client
from m27.client.report import ReportClient
from m27.client.scheduler import SchedulerClient
from m27.common import subjects
from m27.common.api_auth import ApiAccess, Keys
from m27.common.bus import Bus
from m27.common.config import ApiSection
from m27.common.errors import M27Error, Unavailable
from m27.common.model import ServiceInfo

ORCHESTRATOR: Final = "orchestrator"
SCHEDULER: Final = "scheduler"
REPORT: Final = "report"
CALL_TIMEOUT_S: Final = 15.0


class NotRegistered(Unavailable):
    """No instance of a service is registered: m27 is (partly) down."""


def newest(services: Iterable[tuple[str, ServiceInfo]], name: str) -> str | None:
    """The gRPC address of the most recently started instance of `name` (a crashed one
    leaves its registration behind), or None; ties go to the smaller key."""
    candidates = [(-info.started_at, key, info.grpc_address) for key, info in services
                  if key.startswith(f"{name}.") and info.grpc_address]
    return min(candidates)[2] if candidates else None


class M27Api:
    """Opens clients of the m27 services for one user at a time."""

    def __init__(self, nats: Bus, keys: Keys, section: ApiSection, *, api: str = "") -> None:
        self._nats = nats
        self._keys = keys
        self._section = section
        self._api = api

    def access(self, user: str) -> ApiAccess:
        """Calls as `user` (role `user`), with a fresh short-lived token on each call."""
        keys = self._keys
        return ApiAccess.of(lambda: keys.mint(user=user, role="user"), self._section)

    async def address(self, name: str) -> str:
        if name == ORCHESTRATOR and self._api:
            return self._api
        found = []
        for key in await self._nats.kv_keys(subjects.SERVICES_BUCKET, f"{name}.>"):
            entry = await self._nats.kv_get(subjects.SERVICES_BUCKET, key, ServiceInfo)
            if entry is not None:
                found.append((key, entry[0]))
        address = newest(found, name)
        if address is None:
            raise NotRegistered(f"no {name} is running")
        return address

    @asynccontextmanager
    async def orchestrator(self, user: str) -> AsyncIterator[Client]:
        address = await self.address(ORCHESTRATOR)
        async with Client(address, access=self.access(user), timeout=CALL_TIMEOUT_S) as client:
            yield client

    @asynccontextmanager
    async def scheduler(self, user: str) -> AsyncIterator[SchedulerClient]:
        address = await self.address(SCHEDULER)
        async with SchedulerClient(address, access=self.access(user),
                                   timeout=CALL_TIMEOUT_S) as client:
            yield client

    @asynccontextmanager
    async def report(self, user: str) -> AsyncIterator[ReportClient]:
        address = await self.address(REPORT)
        async with ReportClient(address, access=self.access(user),
                                timeout=CALL_TIMEOUT_S) as client:
            yield client


def is_down(error: M27Error) -> bool:
    """Does `error` say the system (or a service of it) cannot be reached now?"""
    if isinstance(error, Unavailable):
        return True
    said = str(error)
    return said.startswith(("cannot reach", "the m27 API at")) or "is it up?" in said
