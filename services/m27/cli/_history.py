"""`m27 runs` and `m27 show` while the system is down: the runs kept in JetStream, read
through a nats-server of their own on the stored data (nothing else is started, nothing is
written), listed and filtered exactly as the orchestrator does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import nats.errors
import nats.js.errors

from m27.cli._common import NotRunningError, config, with_client
from m27.client import Client
from m27.common import subjects
from m27.common.bus import Access, NatsBus, connect
from m27.common.errors import BusError, NotFoundError
from m27.embedded import system
from m27.orchestrator.store import RunStore

T = TypeVar("T")


class NoStoredRuns(NotFoundError):
    """The home holds JetStream data but no run was ever stored in it."""

#: A JetStream that has just started may take a moment to recover its streams.
READY_TIMEOUT_S: Final = 10.0


def read_runs(args: argparse.Namespace, online: Callable[[Client], Awaitable[T]],
              offline: Callable[[RunStore], Awaitable[T]]) -> T:
    """`online` against the running system's API; when nothing runs under this home (and
    no --api was given), `offline` against the runs it stored, saying so on stderr."""
    try:
        return with_client(args, online)
    except NotRunningError:
        if args.api or system.read_state(args.home) is not None:
            raise  # another API was named, or the system is partly up: `m27 up` says how
    with system.stored_nats(args.home, config(args).nats) as stored:
        if stored is None:
            raise NotRunningError(f"nothing is running under {args.home} and no runs are "
                                  "stored there: start the system with `m27 up`, or pass "
                                  "--api HOST:PORT / set $M27_API")
        print(f"m27 is not running: these are the runs stored under {args.home} "
              "(start it with `m27 up` to submit, cancel or retry)", file=sys.stderr)
        return asyncio.run(_offline(*stored, offline))


async def _offline(url: str, access: Access, read: Callable[[RunStore], Awaitable[T]]) -> T:
    bus = NatsBus(await connect(url, name="m27-cli-history", access=access))
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        while True:
            try:
                await bus.kv(subjects.RUNS_BUCKET)
                break
            except nats.js.errors.BucketNotFoundError as exc:  # no run was ever stored
                raise NoStoredRuns("no runs are stored under this home yet") from exc
            except (TimeoutError, nats.errors.Error) as exc:
                if loop.time() >= deadline:
                    raise BusError(f"cannot read the stored runs: {exc}") from exc
                await asyncio.sleep(0.2)
        return await read(RunStore(bus))
    finally:
        await bus.close()
