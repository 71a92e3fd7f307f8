"""Carrying out maintenance windows: the effects `_windows.advance` and `_windows.finished`
return become KV writes (the window record, the node's maintenance mark), the node command
and the `node_maintenance_window` events. The scheduler calls it under its lock."""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping

from m27.common import events, subjects
from m27.common.bus import Bus
from m27.common.logging import get_logger
from m27.common.windows import Window, WindowError, check_window, pinned, same_window
from m27.scheduler._state import Maintenance
from m27.scheduler._windows import (
    Step,
    WindowRecord,
    advance,
    finished,
    scheduled,
    window_in_s,
)

log = get_logger()


def stamp(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


class Windows:
    """The windows by node, kept in KV `m27_windows` and in memory."""

    def __init__(self, bus: Bus, maintenance: Callable[[], MutableMapping[str, Maintenance]],
                 tasks_on: Callable[[str], int]) -> None:
        self.bus = bus
        self.records: dict[str, WindowRecord] = {}
        self._maintenance = maintenance  # the scheduler's marks (replaced on every refresh)
        self._tasks_on = tasks_on

    async def load(self) -> None:
        found: dict[str, WindowRecord] = {}
        for key in await self.bus.kv_keys(subjects.WINDOWS_BUCKET):
            got = await self.bus.kv_get(subjects.WINDOWS_BUCKET, key, WindowRecord)
            if got is not None:
                found[got[0].window.node_id] = got[0]
        self.records = found

    def near(self, now: float) -> dict[str, float]:
        """node → seconds until its window, where that is within the window's lead."""
        return {node: near for node, record in self.records.items()
                if (near := window_in_s(record, now)) is not None}

    async def set(self, window: Window, now: float) -> WindowRecord | None:
        """Store a new window for its node (replacing one that is not in progress)."""
        window = pinned(check_window(window), now)
        current = self.records.get(window.node_id)
        if current is not None and current.phase != "scheduled":
            raise WindowError(f"node {window.node_id}'s window is {current.phase} now: set "
                              "a new one when it has ended")
        record = scheduled(window, now)
        await self._store(window.node_id, record)
        return record

    async def apply_config(self, configured: list[Window], now: float) -> None:
        """`[scheduler] windows`: each configured window replaces its node's unless that is
        the same or in progress (a window set with `m27 node maintain` for another node is
        left alone)."""
        for window in configured:
            current = self.records.get(window.node_id)
            wanted = pinned(window, now)
            if current is not None and (current.phase != "scheduled"
                                        or same_window(current.window, wanted)):
                continue
            record = scheduled(wanted, now)
            if record is not None:
                log.info("window.configured", node_id=window.node_id, at=window.at,
                         every=window.every)
                await self._store(window.node_id, record)

    async def clear(self, node_id: str) -> WindowRecord | None:
        record = self.records.get(node_id)
        if record is not None:
            await self._store(node_id, None)
        return record

    async def tick(self, now: float) -> None:
        for node_id, record in list(self.records.items()):
            step = advance(record, now, tasks_on_node=self._tasks_on(node_id))
            if step.record != record or step.effects:
                await self._apply(node_id, record, step, now)

    async def command_done(self, done: events.MaintenanceCommandDone, now: float) -> None:
        record = self.records.get(done.node_id)
        if record is None:
            return
        step = finished(record, now, occurrence=done.occurrence, exit_code=done.exit_code,
                        error=done.error)
        if step is None:
            log.info("window.late_answer", node_id=done.node_id, occurrence=done.occurrence)
            return
        await self._apply(node_id=done.node_id, before=record, step=step, now=now, done=done)

    async def _store(self, node_id: str, record: WindowRecord | None) -> None:
        if record is None:
            await self.bus.kv_delete(subjects.WINDOWS_BUCKET, node_id)
            self.records.pop(node_id, None)
        else:
            await self.bus.kv_put(subjects.WINDOWS_BUCKET, node_id, record)
            self.records[node_id] = record

    async def _mark(self, node_id: str, mark: Maintenance | None) -> None:
        marks = self._maintenance()
        if mark is None:
            await self.bus.kv_delete(subjects.MAINTENANCE_BUCKET, node_id)
            marks.pop(node_id, None)
        else:
            await self.bus.kv_put(subjects.MAINTENANCE_BUCKET, node_id, mark)
            marks[node_id] = mark

    async def _apply(self, node_id: str, before: WindowRecord, step: Step, now: float,
                     done: events.MaintenanceCommandDone | None = None) -> None:
        """Effects first (each is idempotent), the record last: a scheduler that dies in
        between redoes them from the record it finds."""
        occurrence = before.next_at if before.phase == "scheduled" else before.occurrence
        occurrence = occurrence or 0.0
        window = before.window
        after_next = step.record.next_at if step.record is not None else None

        async def event(phase: events.WindowPhase, **fields: object) -> None:
            await self.bus.publish(
                subjects.node_events(node_id),
                events.NodeMaintenanceWindow(at=now, node_id=node_id, phase=phase,
                                             occurrence=occurrence, command=window.command,
                                             **fields),  # type: ignore[arg-type]
                msg_id=f"window:{node_id}:{occurrence}:{phase}")

        for effect in step.effects:
            if effect == "drain":
                await self._mark(node_id, Maintenance(
                    node_id=node_id, state="draining", at=now, evacuate=True,
                    reason=f"maintenance window of {stamp(occurrence)}"))
                log.warning("window.draining", node_id=node_id, occurrence=occurrence)
                await event("draining")
            elif effect == "run":
                await self.bus.publish(
                    subjects.node_commands(node_id),
                    events.RunMaintenance(at=now, node_id=node_id, occurrence=occurrence,
                                          command=window.command,
                                          timeout_s=window.timeout_s),
                    msg_id=f"maintenance:{node_id}:{occurrence}")
                log.warning("window.command_sent", node_id=node_id, occurrence=occurrence)
                await event("running")
            elif effect == "uncordon":
                await self._mark(node_id, None)
            elif effect == "report_succeeded":
                log.info("window.succeeded", node_id=node_id, occurrence=occurrence)
                await event("succeeded", exit_code=done.exit_code if done else 0,
                            output_tail=done.output_tail if done else "",
                            duration_s=done.duration_s if done else None, next_at=after_next)
            elif effect == "report_failed":
                log.error("window.failed", node_id=node_id, occurrence=occurrence,
                          detail=step.detail)
                await self._mark(node_id, Maintenance(
                    node_id=node_id, state="cordoned", at=now,
                    reason=f"maintenance window of {stamp(occurrence)} failed: "
                    f"{step.detail[:500]} (`m27 node uncordon {node_id}` returns it)"))
                await event("failed", detail=step.detail,
                            exit_code=done.exit_code if done else None,
                            output_tail=done.output_tail if done else "",
                            duration_s=done.duration_s if done else None, next_at=after_next)
        await self._store(node_id, step.record)
