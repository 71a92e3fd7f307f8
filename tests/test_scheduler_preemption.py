"""Preemption end to end, with a real node-agent on one simulated GPU.

An urgent submission finds the GPU held by a low-priority, preemptible background step.
The scheduler preempts it (checkpoint-then-stop: SIGTERM, the step saves where it is), the
agent reports cause `preempted`, the orchestrator requeues it without using a retry budget
and with its first queue time, the urgent step runs, and the background step then resumes
from its checkpoint and finishes without redoing or skipping a step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.client import Client
from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.common.ids import task_id
from m27.orchestrator import runs
from m27.pipeline import load_pipeline
from tests.scheduling_support import (
    COUNTER,
    agent_system,
    counts,
    poll_queue,
    queue,
    scheduler_log,
    scheduler_metrics,
    wait_step,
)
from tests.support import Cluster, finished_run, lines, wait_for

pytestmark = pytest.mark.integration

BACKGROUND = ("priority: low\npreemptible: true\npipeline:\n"
              "  - {name: sweep, type: gpu, command: '\"$M27_PYTHON\" counter.py sweep 60'}\n")
URGENT = ("priority: urgent\npipeline:\n"
          "  - {name: fix, type: gpu, command: 'sleep 4 && date +%s.%N > urgent.done'}\n")


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    yield from agent_system(tmp_path, "node-1")


async def test_an_urgent_step_preempts_a_background_one_which_resumes_from_its_checkpoint(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "counter.py").write_text(COUNTER)
    log = work / "sweep.log"
    background = await client.submit(BACKGROUND, workdir=str(work))
    await wait_for(lambda: len(counts(log, 1)) >= 15, "the background step does not run")
    first_queued = (await wait_step(client, background, "sweep", lambda s: s.queued_at
                                    is not None, "not queued")).queued_at
    urgent = await client.submit(URGENT, workdir=str(work))

    # While the urgent step runs, the preempted one waits with its original queue time.
    await wait_step(client, urgent, "fix", lambda s: s.state == "running",
                    "the urgent step never ran", timeout=40)
    requeued = await poll_queue(
        system, lambda items: next((i for i in items if i.task_id == f"{background}/sweep"
                                    and i.attempt == 2), None),
        "the preempted step was not requeued", explain=True, timeout=10)
    assert requeued.state == "waiting"
    assert requeued.queued_at == pytest.approx(first_queued, abs=0.01)
    # Thrash is visible: the requeue says it was preempted before any checkpoint was
    # committed (the counter keeps its state in a file, not the checkpoint-store) ...
    assert (requeued.preemptions, requeued.fruitless_preemptions) == (1, 1)
    fix = next(item for item in await queue(system, explain=True)
               if item.task_id == f"{urgent}/fix")
    assert fix.protected == "not preemptible"
    # ... and the scheduler counts the stop it sent, by kind, for Prometheus.
    metrics = await scheduler_metrics(system)
    assert 'm27_scheduler_preemptions_total{kind="preemption"} 1\n' in metrics, metrics
    assert 'm27_scheduler_preemptions_total{kind="drain"} 0\n' in metrics
    assert (requeued.urgency, requeued.tier) == ("low", "background")
    assert requeued.reason, "a waiting task says why it waits"

    # The orchestrator notes which attempt committed a checkpoint (the test plays the
    # checkpoint-store): a preemption of that attempt would not be fruitless.
    await wait_step(client, background, "sweep",
                    lambda s: (s.state, s.attempt) == ("running", 2), "not resumed", timeout=40)
    assert await checkpointed_attempt(system, background, "sweep") == 2

    bg_run = await finished_run(client, background)
    urgent_run = await finished_run(client, urgent)
    assert (bg_run.state, urgent_run.state) == ("succeeded", "succeeded"), system.logs()
    sweep = bg_run.steps[0]
    first = sweep.history[0]
    assert first.cause == "preempted", sweep.history
    assert f"make room for {urgent}/fix" in first.reason
    assert (sweep.attempt, sweep.failures, sweep.infra_failures, sweep.preemptions) == \
        (2, 0, 0, 1)

    # The checkpoint the first attempt saved on SIGTERM is where the second resumed.
    saved = [line for line in lines(log) if line.startswith("1 checkpoint ")]
    assert len(saved) == 1, lines(log)
    at = int(saved[0].split()[2])
    assert counts(log, 1) == list(range(1, at + 1))
    assert counts(log, 2) == list(range(at + 1, 61)), "work redone or skipped"
    assert f"resumes at {at}" in sweep.stdout_tail
    # ... and it resumed only after the urgent step had finished with the GPU.
    urgent_done = float((work / "urgent.done").read_text())
    resumed = next(float(line.split()[2]) for line in lines(log) if line.startswith("2 "))
    assert resumed > urgent_done - 0.5
    assert "task.preempted" in scheduler_log(system)
    assert time.time() - urgent_done < 120


async def checkpointed_attempt(system: Cluster, run_id: str, step: str) -> int:
    """Publish the store's `checkpoint_committed` for the step's current attempt; the
    attempt the orchestrator's stored run then records as checkpointed."""
    bus = await NatsBus.open(system.nats_url, name="test-checkpoint")
    try:
        got = await bus.kv_get(subjects.RUNS_BUCKET, run_id, runs.StoredRun)
        assert got is not None
        record = got[0].run.step(step)
        assert record is not None
        await bus.publish(subjects.task_events(run_id, step, subjects.CHECKPOINT_STORE_SENDER),
                          events.CheckpointCommitted(
            at=time.time(), task_id=task_id(run_id, step), attempt=record.attempt,
            checkpoint_id="c-test"))
        deadline = time.monotonic() + 10
        while True:
            got = await bus.kv_get(subjects.RUNS_BUCKET, run_id, runs.StoredRun)
            assert got is not None
            record = got[0].run.step(step)
            assert record is not None
            if record.checkpointed_attempt or time.monotonic() > deadline:
                return record.checkpointed_attempt
            await asyncio.sleep(0.05)
    finally:
        await bus.close()


# ---------------------------------------------------------------- the orchestrator's part

RUN = "r-20261201-000000-abcdef"
RETRY_ONCE = """\
priority: high
pipeline:
  - {name: train, type: gpu, command: x, retries: {failure: 0, infrastructure: 1}}
"""


def _event(stored: runs.StoredRun, now: float, **fields: object) -> runs.StoredRun:
    step = stored.run.step("train")
    assert step is not None
    common = {"at": now, "task_id": task_id(RUN, "train"), "run_id": RUN, "step": "train",
              "attempt": step.attempt, "node_id": "n1"}
    event: events.TaskEvent = (events.TaskStarted(**common, pid=1)  # type: ignore[arg-type]
                               if "exit_code" not in fields else
                               events.TaskExited(**common, **fields))  # type: ignore[arg-type]
    changed = runs.apply_task_event(stored, event, now)
    assert changed is not None
    return runs.without_published(changed, [o.msg_id for o in changed.outbox])


def _enqueued(stored: runs.StoredRun) -> list[events.EnqueueTask]:
    return [o.message for o in stored.outbox if isinstance(o.message, events.EnqueueTask)]


def test_a_preempted_step_is_requeued_at_once_with_its_priority_and_no_budget_used() -> None:
    stored = runs.new_run(load_pipeline(RETRY_ONCE), run_id=RUN, user="ada", variables={},
                          workdir="/w", now=100.0)
    stored = runs.without_published(stored, [o.msg_id for o in stored.outbox])
    for attempt in (1, 2, 3):  # more preemptions than the infrastructure budget (1)
        stored = _event(stored, 100.0 + attempt * 100)
        step = stored.run.step("train")
        assert step is not None
        assert step.attempt == attempt
        changed = runs.apply_task_event(stored, events.TaskExited(
            at=150.0 + attempt * 100, task_id=task_id(RUN, "train"), run_id=RUN,
            step="train", attempt=attempt, node_id="n1", exit_code=143, cause="preempted",
            reason="killed by SIGTERM: stopped: make room for x"), 150.0 + attempt * 100)
        assert changed is not None
        (again,) = _enqueued(changed)
        stored = runs.without_published(changed, [o.msg_id for o in changed.outbox])
        step = stored.run.step("train")
        assert step is not None
        assert (step.state, step.attempt, step.preemptions) == ("retrying", attempt + 1,
                                                                 attempt)
        assert (step.failures, step.infra_failures) == (0, 0)
        assert "no retry budget used" in step.reason
        # the same urgency, its first queue time, no backoff, and the GPU time it held
        assert (again.urgency, again.queued_at, again.not_before) == ("high", 100.0, 0.0)
        assert again.attained_gpu_s == pytest.approx(50.0 * attempt)
    # a real infrastructure loss still counts against its own budget
    stored = _event(stored, 1000.0)
    stored = _event(stored, 1001.0, exit_code=None, cause="lost")
    step = stored.run.step("train")
    assert step is not None
    assert (step.state, step.infra_failures) == ("retrying", 1)
