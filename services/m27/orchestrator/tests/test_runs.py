"""The run state machine: release order, failures, cancellation, duplicates, the outbox."""

from __future__ import annotations

import msgspec
import pytest

from m27.common import events, subjects
from m27.common.ids import task_id
from m27.orchestrator import runs
from m27.pipeline import load_pipeline

RUN = "r-20261201-000000-abcdef"
SEED = """\
pipeline:
  - {name: prep, type: cpu, command: "echo prep"}
  - {name: train, type: gpu, command: "echo train", depends_on: [prep]}
  - {name: other, type: cpu, command: "echo other"}
  - {name: analysis, type: gpu_light, command: "echo a", depends_on: [train]}
"""


def start(text: str = SEED, use_cache: bool = False) -> runs.StoredRun:
    spec = load_pipeline(text, urgency="high")
    return runs.new_run(spec, run_id=RUN, user="ada", variables={}, workdir="/w", now=100.0,
                        use_cache=use_cache)


def flush(stored: runs.StoredRun) -> tuple[runs.StoredRun, list[events.Message]]:
    sent = [o.message for o in stored.outbox]
    return runs.without_published(stored, [o.msg_id for o in stored.outbox]), sent


def started(stored: runs.StoredRun, step: str, now: float) -> runs.StoredRun:
    record = stored.run.step(step)
    assert record is not None
    event = events.TaskStarted(at=now, task_id=task_id(RUN, step), run_id=RUN, step=step,
                               attempt=record.attempt, node_id="n1", pid=42)
    result = runs.apply_task_event(stored, event, now)
    assert result is not None
    return result


def exited(stored: runs.StoredRun, step: str, code: int, now: float,
           **extra: object) -> runs.StoredRun:
    record = stored.run.step(step)
    assert record is not None
    event = events.TaskExited(at=now, task_id=task_id(RUN, step), run_id=RUN, step=step,
                              attempt=record.attempt, node_id="n1", exit_code=code,
                              stderr_tail="boom" if code else "", **extra)  # type: ignore[arg-type]
    result = runs.apply_task_event(stored, event, now)
    assert result is not None
    return result


def states(stored: runs.StoredRun) -> dict[str, str]:
    return {s.name: s.state for s in stored.run.steps}


def test_new_run_queues_only_steps_without_dependencies() -> None:
    stored, sent = flush(start())
    assert states(stored) == {"prep": "queued", "other": "queued", "train": "pending",
                              "analysis": "pending"}
    enqueued = [m for m in sent if isinstance(m, events.EnqueueTask)]
    assert [m.step for m in enqueued] == ["prep", "other"]
    assert all(m.attempt == 1 and m.urgency == "high" and m.workdir == "/w" for m in enqueued)
    assert isinstance(sent[0], events.RunSubmitted)
    assert stored.run.state == "queued"


def test_outbox_ids_are_unique_and_subjects_match_messages() -> None:
    stored = start()
    ids = [o.msg_id for o in stored.outbox]
    assert len(ids) == len(set(ids))
    for outgoing in stored.outbox:
        if isinstance(outgoing.message, events.EnqueueTask):
            assert outgoing.subject == subjects.SCHEDULER_COMMANDS
        elif isinstance(outgoing.message, events.StepStateChanged):
            assert outgoing.subject == subjects.step_state(RUN, outgoing.message.step)


def test_success_releases_dependents_and_finishes_the_run() -> None:
    stored, _ = flush(start())
    stored, sent = flush(started(stored, "prep", 101))
    assert stored.run.state == "running"
    assert any(isinstance(m, events.RunStateChanged) and m.state == "running" for m in sent)
    stored, sent = flush(exited(stored, "prep", 0, 102))
    assert states(stored)["train"] == "queued"
    assert [m.step for m in sent if isinstance(m, events.EnqueueTask)] == ["train"]
    for name, t in (("other", 103), ("train", 104), ("analysis", 106)):
        if states(stored)[name] == "queued":
            stored, _ = flush(started(stored, name, t))
        stored, sent = flush(exited(stored, name, 0, t + 1))
    assert stored.run.state == "succeeded"
    assert stored.run.ended_at == 107
    assert sent[-1] == events.RunStateChanged(at=107, run_id=RUN, state="succeeded",
                                              previous="running")


def test_failure_skips_descendants_but_independent_steps_continue() -> None:
    stored, _ = flush(start())
    stored, _ = flush(started(stored, "prep", 101))
    stored, sent = flush(exited(stored, "prep", 3, 102))
    assert states(stored) == {"prep": "failed", "train": "skipped", "analysis": "skipped",
                              "other": "queued"}
    skipped = [m for m in sent if isinstance(m, events.StepStateChanged)
               and m.state == "skipped"]
    assert [(m.step, m.reason) for m in skipped] == [
        ("train", "upstream step prep failed"), ("analysis", "upstream step prep failed")]
    prep = stored.run.step("prep")
    assert prep is not None
    assert prep.exit_code == 3
    assert prep.stderr_tail == "boom"
    assert stored.run.state == "running"
    stored, _ = flush(started(stored, "other", 103))
    stored, _ = flush(exited(stored, "other", 0, 104))
    assert stored.run.state == "failed"
    assert "prep" in stored.run.reason


def test_duplicate_and_stale_events_change_nothing() -> None:
    stored, _ = flush(start())
    stored, _ = flush(started(stored, "prep", 101))
    again = events.TaskStarted(at=101, task_id=task_id(RUN, "prep"), run_id=RUN, step="prep",
                               attempt=1, node_id="n1", pid=42)
    assert runs.apply_task_event(stored, again, 101.5) is None
    stale = events.TaskExited(at=102, task_id=task_id(RUN, "prep"), run_id=RUN, step="prep",
                              attempt=0, node_id="n1", exit_code=0)
    assert runs.apply_task_event(stored, stale, 102) is None
    unknown = events.TaskExited(at=102, task_id=task_id(RUN, "nope"), run_id=RUN, step="nope",
                                attempt=1, node_id="n1", exit_code=0)
    assert runs.apply_task_event(stored, unknown, 102) is None
    stored, _ = flush(exited(stored, "prep", 0, 103))
    late = events.TaskExited(at=104, task_id=task_id(RUN, "prep"), run_id=RUN, step="prep",
                             attempt=1, node_id="n1", exit_code=1)
    assert runs.apply_task_event(stored, late, 104) is None


def test_cancel_stops_running_and_cancels_the_rest() -> None:
    stored, _ = flush(start())
    stored, _ = flush(started(stored, "prep", 101))
    cancelled = runs.request_cancel(stored, "user asked", 102)
    assert cancelled is not None
    stored, sent = flush(cancelled)
    stops = [m for m in sent if isinstance(m, events.CancelTask)]
    assert {m.task_id for m in stops} == {task_id(RUN, "prep"), task_id(RUN, "other")}
    assert states(stored) == {"prep": "running", "other": "cancelled", "train": "cancelled",
                              "analysis": "cancelled"}
    assert stored.run.state == "running"
    assert runs.request_cancel(stored, "again", 103) is None
    stored, sent = flush(exited(stored, "prep", 143, 104, signal=15))
    assert states(stored)["prep"] == "cancelled"
    assert stored.run.state == "cancelled"
    assert not [m for m in sent if isinstance(m, events.EnqueueTask)]


def test_cancelling_a_finished_run_does_nothing() -> None:
    stored, _ = flush(start())
    for name in ("prep", "other"):
        stored, _ = flush(started(stored, name, 101))
        stored, _ = flush(exited(stored, name, 1, 102))
    assert stored.run.state == "failed"
    assert runs.request_cancel(stored, "late", 103) is None


def test_a_step_that_never_started_fails_with_the_reason() -> None:
    stored, _ = flush(start())
    stored = exited(stored, "prep", 127, 101, started=False, reason="could not start: no dir")
    prep = stored.run.step("prep")
    assert prep is not None
    assert prep.state == "failed"
    assert prep.reason == "could not start: no dir"


def test_placement_is_recorded_without_a_state_change() -> None:
    stored, _ = flush(start())
    placed = events.TaskPlaced(at=100.5, task_id=task_id(RUN, "prep"), run_id=RUN, step="prep",
                               attempt=1, node_id="n2", gpu_ids=(1,), gpu_share=0.5,
                               gpu_simulated=True)
    updated = runs.apply_task_event(stored, placed, 100.5)
    assert updated is not None
    prep = updated.run.step("prep")
    assert prep is not None
    assert (prep.state, prep.node_id, prep.gpu_ids, prep.gpu_simulated) == \
        ("queued", "n2", (1,), True)
    assert updated.outbox == ()


def test_report_path_is_recorded_once() -> None:
    stored, _ = flush(start())
    ready = events.ReportReady(at=1.0, run_id=RUN, path=f"/r/{RUN}.html")
    updated = runs.record_report(stored, ready)
    assert updated is not None
    assert updated.run.report_path == f"/r/{RUN}.html"
    assert runs.record_report(updated, ready) is None


@pytest.mark.parametrize("path", ["/etc/passwd", f"r/{RUN}.html", f"/r/../{RUN}.html",
                                  "/r/r-20990101-000000-ffffff.html", ""])
def test_a_report_pointed_anywhere_but_the_runs_own_file_is_refused(path: str) -> None:
    stored, _ = flush(start())
    ready = events.ReportReady(at=1.0, run_id=RUN, path=path)
    assert runs.report_path_problem(ready)
    assert runs.record_report(stored, ready) is None


RETRYING = """\
pipeline:
  - name: flaky
    command: x
    retries: {failure: 2, infrastructure: 1, backoff: {initial: 10s, factor: 3, max: 60s}}
  - {name: after, command: y, depends_on: [flaky]}
"""


def exit_as(stored: runs.StoredRun, step: str, now: float, code: int | None,
            cause: str = "exit") -> runs.StoredRun:
    stored, _ = flush(started(stored, step, now))
    return exited(stored, step, code, now + 1, cause=cause)  # type: ignore[arg-type]


def test_program_failures_are_retried_with_growing_backoff_then_fail() -> None:
    stored, _ = flush(start(RETRYING))
    stored, sent = flush(exit_as(stored, "flaky", 101, 3))
    flaky = stored.run.step("flaky")
    assert flaky is not None
    assert (flaky.state, flaky.attempt, flaky.failures) == ("retrying", 2, 1)
    assert "failure retry 1 of 2 in 10s" in flaky.reason
    (again,) = [m for m in sent if isinstance(m, events.EnqueueTask)]
    assert (again.attempt, again.not_before) == (2, 102 + 10)
    stored, sent = flush(exit_as(stored, "flaky", 120, 3))
    (again,) = [m for m in sent if isinstance(m, events.EnqueueTask)]
    assert again.not_before == 121 + 30
    stored, _ = flush(exit_as(stored, "flaky", 160, 3))
    flaky = stored.run.step("flaky")
    assert flaky is not None
    assert flaky.state == "failed"
    assert flaky.reason == "exit code 3 (after 2 retries)"
    assert [a.attempt for a in flaky.history] == [1, 2, 3]
    assert stored.run.state == "failed"


def test_infrastructure_losses_have_their_own_budget() -> None:
    stored, _ = flush(start(RETRYING))
    stored, _ = flush(exit_as(stored, "flaky", 101, None, cause="lost"))
    flaky = stored.run.step("flaky")
    assert flaky is not None
    assert (flaky.state, flaky.infra_failures, flaky.failures) == ("retrying", 1, 0)
    assert "infrastructure retry 1 of 1" in flaky.reason
    stored, _ = flush(exit_as(stored, "flaky", 120, 2))
    flaky = stored.run.step("flaky")
    assert flaky is not None
    assert (flaky.state, flaky.failures) == ("retrying", 1)
    stored, _ = flush(exit_as(stored, "flaky", 150, None, cause="node_stopped"))
    flaky = stored.run.step("flaky")
    assert flaky is not None
    assert flaky.state == "failed"


def test_a_retried_step_that_succeeds_releases_its_dependents() -> None:
    stored, _ = flush(start(RETRYING))
    stored, _ = flush(exit_as(stored, "flaky", 101, 1))
    stored, sent = flush(exit_as(stored, "flaky", 120, 0))
    assert states(stored) == {"flaky": "succeeded", "after": "queued"}
    assert [m.step for m in sent if isinstance(m, events.EnqueueTask)] == ["after"]


def test_missing_outputs_and_timeouts_are_program_failures() -> None:
    text = "pipeline:\n  - {name: a, command: x, output: o.txt}\n"
    stored, _ = flush(start(text))
    stored, _ = flush(started(stored, "a", 101))
    done = events.TaskExited(at=102, task_id=task_id(RUN, "a"), run_id=RUN, step="a",
                             attempt=1, node_id="n1", exit_code=0, missing_outputs=("o.txt",))
    failed = runs.apply_task_event(stored, done, 102)
    assert failed is not None
    step = failed.run.step("a")
    assert step is not None
    assert (step.state, step.reason) == ("failed", "declared output(s) missing: o.txt")
    stored, _ = flush(start(text))
    stored = exit_as(stored, "a", 101, 143, cause="timeout")
    step = stored.run.step("a")
    assert step is not None
    assert step.state == "failed"


SWEEP = """\
pipeline:
  - name: t
    matrix: {i: [1, 2, 3, 4, 5]}
    max_parallel: 2
    command: x
"""


def test_a_sweep_runs_at_most_max_parallel_members_at_once() -> None:
    stored, sent = flush(start(SWEEP))
    queued = [m.step for m in sent if isinstance(m, events.EnqueueTask)]
    assert queued == ["t-i1", "t-i2"]
    stored, _ = flush(started(stored, "t-i1", 101))
    stored, sent = flush(exited(stored, "t-i1", 0, 102))
    assert [m.step for m in sent if isinstance(m, events.EnqueueTask)] == ["t-i3"]
    assert sum(s.state in {"queued", "running"} for s in stored.run.steps) == 2


def test_cancelling_one_step_skips_its_dependents_and_the_rest_goes_on() -> None:
    stored, _ = flush(start())
    stored, _ = flush(started(stored, "prep", 101))
    cancelled = runs.request_cancel_step(stored, "prep", "wrong input", 102)
    assert cancelled is not None
    stored, sent = flush(cancelled)
    assert [m.task_id for m in sent if isinstance(m, events.CancelTask)] == [
        task_id(RUN, "prep")]
    stored, _ = flush(exited(stored, "prep", 143, 103, signal=15))
    assert states(stored) == {"prep": "cancelled", "train": "skipped", "analysis": "skipped",
                              "other": "queued"}
    assert runs.request_cancel_step(stored, "prep", "again", 104) is None
    stored, _ = flush(started(stored, "other", 104))
    stored, _ = flush(exited(stored, "other", 0, 105))
    assert stored.run.state == "cancelled"


def test_retry_run_reruns_only_what_did_not_succeed() -> None:
    stored, _ = flush(start())
    for name, code in (("prep", 0), ("other", 4)):
        stored, _ = flush(started(stored, name, 101))
        stored, _ = flush(exited(stored, name, code, 102))
    for name in ("train", "analysis"):
        stored, _ = flush(started(stored, name, 103))
        stored, _ = flush(exited(stored, name, 0 if name == "train" else 9, 104))
    assert stored.run.state == "failed"
    before = stored.run.step("other")
    assert before is not None
    thrashed = msgspec.structs.replace(before, preemptions=4, fruitless_preemptions=3)
    stored = msgspec.structs.replace(stored, run=msgspec.structs.replace(
        stored.run, steps=tuple(thrashed if s.name == "other" else s
                                for s in stored.run.steps)))
    retried = runs.retry_run(stored, 200)
    assert not isinstance(retried, str)
    stored, sent = flush(retried)
    other = stored.run.step("other")
    assert other is not None
    assert (other.preemptions, other.fruitless_preemptions) == (4, 0)
    assert states(stored) == {"prep": "succeeded", "train": "succeeded",
                              "other": "queued", "analysis": "queued"}
    enqueued = {m.step: m.attempt for m in sent if isinstance(m, events.EnqueueTask)}
    assert enqueued == {"other": 2, "analysis": 2}
    assert stored.run.state == "running"
    assert isinstance(runs.retry_run(stored, 201), str)


def test_cache_lookup_decides_between_reuse_and_running() -> None:
    text = "pipeline:\n  - {name: a, command: x, output: o}\n  - {name: b, command: y, " \
           "depends_on: [a], output: p}\n"
    stored, sent = flush(start(text, use_cache=True))
    assert not [m for m in sent if isinstance(m, events.EnqueueTask)]
    assert runs.pending_cache_lookups(stored) == ["a"]
    hit = runs.CacheHit(task_id="r-20261130-000000-000000/a", outputs=("/w/o",))
    reused = runs.resolve_cache(stored, "a", "k1", hit, 101)
    assert reused is not None
    stored, sent = flush(reused)
    a = stored.run.step("a")
    assert a is not None
    assert (a.state, a.cached_from, a.cache_key) == ("succeeded", hit.task_id, "k1")
    assert runs.pending_cache_lookups(stored) == ["b"]
    missed = runs.resolve_cache(stored, "b", "k2", None, 102)
    assert missed is not None
    stored, sent = flush(missed)
    assert [m.step for m in sent if isinstance(m, events.EnqueueTask)] == ["b"]
    assert runs.resolve_cache(stored, "b", "k2", None, 103) is None


def test_a_step_is_enqueued_with_what_it_reads_for_the_ready_pool() -> None:
    """Its `inputs:` and its dependencies' outputs, absolute, each once: what the ready pool
    has the agent read ahead."""
    text = """\
pipeline:
  - {name: prep, type: cpu, command: "echo", outputs: [shards/, /abs/vocab.txt]}
  - {name: train, type: gpu, command: "echo", depends_on: [prep], workdir: sub,
     inputs: [config.yaml, /abs/vocab.txt, ../shards/]}
"""
    stored, _ = flush(start(text))
    stored, _ = flush(started(stored, "prep", 101))
    _, sent = flush(exited(stored, "prep", 0, 102))
    (train,) = [m for m in sent if isinstance(m, events.EnqueueTask)]
    assert train.inputs == ("/w/sub/config.yaml", "/abs/vocab.txt", "/w/shards")


# ---------------------------------------------------------------- fruitless preemptions

PREEMPTIBLE = "pipeline:\n  - {name: sweep, type: gpu, command: x, preemptible: true}\n"


def committed(stored: runs.StoredRun, attempt: int) -> runs.StoredRun | None:
    """The checkpoint-store's `checkpoint_committed` for that attempt of the sweep."""
    return runs.record_checkpoint(stored, "sweep", attempt)


def preempted(stored: runs.StoredRun, now: float) -> tuple[runs.StoredRun, events.EnqueueTask]:
    """The sweep runs and is preempted; the run afterwards and its requeue."""
    stored, _ = flush(started(stored, "sweep", now))
    stored, sent = flush(exited(stored, "sweep", 143, now + 1, cause="preempted",
                                reason="stopped: make room for r/urgent"))
    (again,) = [m for m in sent if isinstance(m, events.EnqueueTask)]
    return stored, again


def test_preemptions_without_a_checkpoint_are_counted_and_one_after_a_checkpoint_resets() -> None:
    """What the scheduler's thrash protection reads: every requeue carries how often the
    step was preempted, and how many of the latest preemptions in a row found its attempt
    without a committed checkpoint."""
    stored, _ = flush(start(PREEMPTIBLE))
    for n in (1, 2):  # preempted twice before it committed anything
        stored, again = preempted(stored, 100.0 * n)
        assert (again.attempt, again.preemptions, again.fruitless_preemptions) == (n + 1, n, n)
    # a checkpoint of the attempt before does not count for this one
    assert committed(stored, 2) is None
    changed = committed(stored, 3)
    assert changed is not None
    assert committed(changed, 3) is None  # a repeat writes nothing
    step = changed.run.step("sweep")
    assert step is not None
    assert (step.checkpointed_attempt, step.fruitless_preemptions) == (3, 2)
    stored, again = preempted(changed, 300.0)
    assert (again.attempt, again.preemptions, again.fruitless_preemptions) == (4, 3, 0)
    stored, again = preempted(stored, 400.0)  # attempt 4 committed nothing
    assert (again.preemptions, again.fruitless_preemptions) == (4, 1)
    step = stored.run.step("sweep")
    assert step is not None
    assert (step.preemptions, step.fruitless_preemptions) == (4, 1)


def test_a_failure_retry_carries_the_preemption_counts() -> None:
    """A retry after a program failure is no preemption: the counts go along unchanged."""
    text = ("pipeline:\n  - {name: sweep, type: gpu, command: x, preemptible: true, "
            "retries: {failure: 1}}\n")
    stored, _ = flush(start(text))
    stored, _ = preempted(stored, 100.0)
    stored, _ = flush(started(stored, "sweep", 200.0))
    _, sent = flush(exited(stored, "sweep", 1, 201.0))
    (again,) = [m for m in sent if isinstance(m, events.EnqueueTask)]
    assert (again.attempt, again.preemptions, again.fruitless_preemptions) == (3, 1, 1)
