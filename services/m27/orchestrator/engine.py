"""Runs as the rest of the orchestrator sees them: the store plus what follows a change.

Every change goes through `change`: the pure core decides, the store writes it with
compare-and-set and publishes its outbox, and then the follow-ups run — cache lookups for
steps that were released (which may release more), and remembering the results of steps
that succeeded. Follow-ups are driven by the stored state, so after a crash `recover`
simply finds and finishes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from m27.common.errors import NotFoundError
from m27.common.logging import get_logger
from m27.orchestrator import runs
from m27.orchestrator.caching import Cache
from m27.orchestrator.runs import StoredRun
from m27.orchestrator.secrets import Secrets
from m27.orchestrator.store import RunStore

log = get_logger()

MAX_LOOKUP_ROUNDS: Final = 10_000


class Engine:
    def __init__(self, store: RunStore, cache: Cache) -> None:
        self.store = store
        self.cache = cache
        self.secrets = Secrets(store.bus)

    async def create(self, stored: StoredRun) -> StoredRun:
        await self.store.create(stored)
        return await self._ended(stored.run.state, await self._follow_up(stored))

    async def change(self, run_id: str,
                     decide: Callable[[StoredRun], StoredRun | None]) -> StoredRun:
        before: list[str] = []

        def watched(current: StoredRun) -> StoredRun | None:
            before[:] = [current.run.state]
            return decide(current)

        stored = await self._follow_up(await self.store.mutate(run_id, watched))
        return await self._ended(before[0] if before else stored.run.state, stored)

    async def _ended(self, before: str, stored: StoredRun) -> StoredRun:
        """A run that has just succeeded needs its secret values no more."""
        if stored.run.state == "succeeded" and before != "succeeded":
            await self.secrets.forget(stored.run.secret_keys)
        return stored

    async def step_succeeded(self, stored: StoredRun, name: str) -> None:
        """Keep the results of a step that succeeded by running, for later runs to reuse."""
        step = stored.run.step(name)
        if step is None or step.state != "succeeded":
            return
        try:
            await self.cache.store(stored.run, step, time.time())
        except OSError as exc:  # results stay valid; only reuse is lost
            log.warning("cache.store_failed", step=name, error=str(exc))

    async def _follow_up(self, stored: StoredRun) -> StoredRun:
        for _ in range(MAX_LOOKUP_ROUNDS):
            waiting = runs.pending_cache_lookups(stored)
            if not waiting:
                return stored
            name = waiting[0]
            step = stored.run.step(name)
            assert step is not None
            key, hit = await self.cache.lookup(stored.run, step)
            stored = await self.store.mutate(stored.run.run_id,
                                             _resolution(name, key, hit))
        return stored

    async def recover(self) -> None:
        """Finish what a crashed orchestrator left: outboxes and cache lookups."""
        await self.store.recover()
        for run_id in await self.store.run_ids():
            try:
                stored, _ = await self.store.get(run_id)
            except NotFoundError:
                continue
            if runs.pending_cache_lookups(stored):
                log.info("runs.recovering_cache_lookups", run_id=run_id)
                await self._follow_up(stored)
            if stored.run.state == "succeeded" and stored.run.secret_keys:
                await self.secrets.forget_left(stored.run.secret_keys)  # a crash came between


def _resolution(name: str, key: str, hit: runs.CacheHit | None
                ) -> Callable[[StoredRun], StoredRun | None]:
    return lambda stored: runs.resolve_cache(stored, name, key, hit, time.time())
