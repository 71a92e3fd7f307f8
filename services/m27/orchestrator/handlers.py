"""What the orchestrator does with task and report events from the bus."""

from __future__ import annotations

import time

from nats.aio.msg import Msg

from m27.common import bus as bus_module
from m27.common import events
from m27.common.errors import NotFoundError
from m27.common.ids import split_task_id
from m27.common.logging import bound_contextvars, get_logger
from m27.orchestrator import runs
from m27.orchestrator.engine import Engine

log = get_logger()


class EventHandlers:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def on_task_event(self, msg: Msg) -> None:
        event = await bus_module.task_event_or_poison(self.engine.store.bus, msg.subject, msg.data)
        if isinstance(event, events.CheckpointCommitted):
            await self._on_checkpoint(event)
            return
        if not isinstance(event, events.TaskPlaced | events.TaskStarted | events.TaskExited):
            return
        with bound_contextvars(run_id=event.run_id, task_id=event.task_id):
            try:
                stored = await self.engine.change(
                    event.run_id, lambda s: runs.apply_task_event(s, event, time.time()))
            except NotFoundError:
                log.warning("task_event.unknown_run", type=events.tag_of(event))
                return
            step = stored.run.step(event.step)
            if isinstance(event, events.TaskExited) and step and step.attempt == event.attempt:
                await self.engine.step_succeeded(stored, event.step)
            log.info("task_event.applied", type=events.tag_of(event),
                     step_state=step.state if step else None, run_state=stored.run.state)

    async def _on_checkpoint(self, event: events.CheckpointCommitted) -> None:
        """Whether an attempt made durable progress decides if its preemption was fruitless
        (the scheduler's thrash protection); one KV write per attempt at most."""
        try:
            run_id, name = split_task_id(event.task_id)
        except ValueError:
            log.warning("checkpoint_event.bad_task_id", task_id=event.task_id)
            return
        try:
            await self.engine.change(
                run_id, lambda s: runs.record_checkpoint(s, name, event.attempt))
        except NotFoundError:
            log.warning("checkpoint_event.unknown_run", run_id=run_id)

    async def on_report(self, msg: Msg) -> None:
        event = bus_module.decode_or_poison(msg.data, events.decode_event)
        if not isinstance(event, events.ReportReady):
            return
        problem = runs.report_path_problem(event)
        if problem:
            raise bus_module.PoisonMessage(f"refused: {problem}")
        try:
            await self.engine.change(event.run_id, lambda s: runs.record_report(s, event))
        except NotFoundError:
            log.warning("report.unknown_run", run_id=event.run_id)
