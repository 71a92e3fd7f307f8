"""The scheduler's shell without NATS: what the policy is shown (`_state`), and that carrying
out a decision twice (a redelivery, a decision repeated after a restart) has one effect."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from m27.common import events, subjects
from m27.common.config import Config, SchedulerSection, load_config, parse_map
from m27.common.errors import ConfigError
from m27.common.memory_bus import MemoryBus
from m27.common.model import Fence, GpuInfo, GpuSample, NodeInfo, Resources
from m27.common.windows import parse_config
from m27.scheduler import api, policy, service
from m27.scheduler._apply import FENCE_KEPT_S, Effects, Table
from m27.scheduler._state import (
    Maintenance,
    NodeView,
    Placement,
    TaskEntry,
    cluster_state,
    job_of,
    policy_settings,
    queue_of,
)
from m27.scheduler._window_shell import Windows
from m27.scheduler.model import (
    Decision,
    Pause,
    Place,
    PolicySettings,
    Preempt,
    Resume,
    Stage,
    Wait,
)

GPU = GpuInfo(index=0, name="m27 simulated GPU", uuid="SIM-0", memory_total_mb=16384,
              simulated=True)


def task(name: str, **fields: Any) -> events.EnqueueTask:
    base: dict[str, Any] = {"at": 0.0, "task_id": f"r/{name}", "run_id": "r", "step": name,
                            "attempt": 1, "step_type": "gpu",
                            "resources": Resources(gpus=1.0), "urgency": "normal",
                            "user": "ada", "command": "true"}
    return events.EnqueueTask(**{**base, **fields})


def info(node_id: str, state: str = "up", temperature: float = 40.0) -> NodeInfo:
    return NodeInfo(node_id=node_id, hostname="h", backend="simulated", gpus=(GPU,),
                    cpu_slots=4, registered_at=0.0, last_heartbeat=0.0, state=state,  # type: ignore[arg-type]
                    samples=(GpuSample(index=0, utilization_pct=55.0, memory_used_mb=1,
                                       temperature_c=temperature, throttle=("power",)),))


# ---------------------------------------------------------------- what the policy sees


@pytest.mark.parametrize(("state", "alive", "mark", "schedulable", "draining"), [
    ("up", True, None, True, False),
    ("up", False, None, False, False),  # silent: not to be given work
    ("stopping", True, None, False, False),
    ("up", True, "cordoned", False, False),
    ("up", True, "draining", False, True),
])
def test_nodes_take_work_only_when_up_alive_and_not_in_maintenance(
        state: str, alive: bool, mark: str | None, schedulable: bool, draining: bool) -> None:
    marks = {"n1": Maintenance(node_id="n1", state=mark)} if mark else {}  # type: ignore[arg-type]
    (node,) = cluster_state([NodeView(info=info("n1", state), alive=alive)], marks, []).nodes
    assert (node.schedulable, node.draining) == (schedulable, draining)
    (gpu,) = node.gpus
    assert (gpu.temperature_c, gpu.throttled, gpu.utilization_pct, gpu.simulated) == (
        40.0, ("power",), 55.0, True)
    assert node.cpu_milli == 4000


def test_running_tasks_carry_their_idle_pause_and_lender_and_the_queue_keeps_queue_time() -> None:
    placed = TaskEntry(task=task("a", preemptible=True, urgency="low"), queued_at=5.0,
                       attained_gpu_s=30.0, placed_at=9.0, started=True, started_at=10.0,
                       idle=True, paused=True, paused_at=12.0, stopping="drain",
                       placement=Placement(task_id="r/a", attempt=1, node_id="n1",
                                           gpu_ids=(0,), gpu_milli=1000, lender="r/main"))
    later = TaskEntry(task=task("c", not_before=100.0), queued_at=1.0)
    waiting = TaskEntry(task=task("b", resources=Resources(gpus=0.3, gpu_memory_mb=2048)),
                        queued_at=3.0, attained_gpu_s=7.0)
    state = cluster_state([NodeView(info=info("n1"), alive=True)], {}, [waiting, placed, later])
    (running,) = state.running
    assert (running.started_at, running.queued_at, running.attained_gpu_s) == (10.0, 5.0, 30.0)
    assert (running.idle, running.paused, running.paused_at, running.lender, running.stopping
            ) == (True, True, 12.0, "r/main", True)
    assert running.job.tier == "background"
    assert running.job.checkpoints
    assert (running.staging, running.computing_since) == (False, 10.0)
    # Placed, not started yet (the agent still restores its checkpoint): not preempted.
    starting = msgspec.structs.replace(placed, started=False, started_at=None, stopping="")
    (running,) = cluster_state([NodeView(info=info("n1"), alive=True)], {}, [starting]).running
    assert running.staging
    assert policy.protection(running, 1e9, PolicySettings()) == "staging its inputs"
    (queued,) = queue_of([waiting, placed, later], now=50.0)  # c waits for its backoff
    assert (queued.job.task_id, queued.queued_at, queued.attained_gpu_s) == ("r/b", 3.0, 7.0)
    assert (queued.job.gpu_milli, queued.job.gpu_memory_mb, queued.job.tier) == (
        300, 2048, "immediate")
    assert [q.job.task_id for q in queue_of([waiting, placed, later], now=100.0)] == [
        "r/c", "r/b"]


def test_the_scheduler_section_becomes_the_policy_settings() -> None:
    section = SchedulerSection(urgency_weights="low:1, normal:2,high:3,urgent:9",
                               user_levels="ada:pi,bob:staff", level_weights="pi:50",
                               min_runtime=30.0, preempt_grace=5.0, backfill=False,
                               ready_pool=0, max_pause=7.0, max_temperature=70.0,
                               peer_yield_gpu_hours=0.5, backfill_pool=3)
    settings = policy_settings(Config(scheduler=section))
    assert settings.urgency_weight == {"low": 1.0, "normal": 2.0, "high": 3.0, "urgent": 9.0}
    assert (settings.user_levels, settings.level_weight) == (
        {"ada": "pi", "bob": "staff"}, {"pi": 50.0})
    assert (settings.min_runtime_s, settings.preempt_grace_s, settings.backfill,
            settings.ready_pool, settings.max_pause_s, settings.max_temperature_c,
            settings.peer_yield_gpu_h, settings.backfill_pool) == (
                30.0, 5.0, False, 0, 7.0, 70.0, 0.5, 3)
    with pytest.raises(ValueError, match="name:value"):
        parse_map("a:1,b")
    with pytest.raises(ConfigError, match="expected name:value, got 'alice'"):
        policy_settings(Config(scheduler=SchedulerSection(user_levels="alice")))
    with pytest.raises(ConfigError, match="could not convert"):
        policy_settings(Config(scheduler=SchedulerSection(level_weights="pi:lots")))
    assert job_of(task("x", checkpoint_interval_s=60.0)).checkpoints


# ---------------------------------------------------------------- idempotent effects


@pytest.fixture
def shell() -> tuple[MemoryBus, Table, Effects]:
    bus = MemoryBus()
    table = Table(bus)
    return bus, table, Effects(bus, table)


async def test_each_decision_applied_twice_has_one_effect(
        shell: tuple[MemoryBus, Table, Effects]) -> None:
    bus, table, effects = shell
    nodes = {"n1": info("n1")}
    await table.store(TaskEntry(task=task("a", preemptible=True), queued_at=1.0))
    await table.store(TaskEntry(task=task("b"), queued_at=2.0))
    place = Place(task_id="r/a", attempt=1, node_id="n1", gpu_ids=(0,), gpu_milli=500,
                  reason="fits", lender="r/main")
    decisions: list[Decision] = [place, Wait(task_id="r/b", reason="needs 1 GPU"),
                 Stage(task_id="r/b", node_id="n1", reason="ready pool"),
                 Pause(task_id="r/a", attempt=1, reason="lender busy"),
                 Resume(task_id="r/a", attempt=1, reason="lender idle"),
                 Preempt(task_id="r/a", attempt=1, reason="make room", grace_s=7.0)]
    for decision in decisions:
        await effects.apply(decision, nodes, 10.0)
        await effects.apply(decision, nodes, 10.5)
    assert bus.kinds() == ["start_task", "task_placed", "pause_task", "resume_task",
                           "stop_task"]
    stop = bus.published[-1][1]
    assert isinstance(stop, events.StopTask)
    assert (stop.cause, stop.grace_s, stop.reason) == ("preempted", 7.0, "make room")
    ids = [msg_id for _, _, msg_id in bus.published]
    assert len(set(ids)) == len(ids)
    a, b = table.entries["r/a"], table.entries["r/b"]
    assert a.placement is not None
    assert (a.placement.gpu_milli, a.placement.lender, a.stopping) == (500, "r/main",
                                                                       "make room")
    assert (b.wait_reason, b.staged_nodes, b.placement) == ("needs 1 GPU", ("n1",), None)


async def test_a_forgotten_task_leaves_its_fence_to_expire_a_newer_attempts_stays(
        shell: tuple[MemoryBus, Table, Effects]) -> None:
    """Found in the soak: a fence stayed for every task ever run (the bucket grew for
    good). An ended attempt's fence is written again with a TTL; a newer one is not."""
    bus, table, effects = shell
    await table.store(TaskEntry(task=task("a"), queued_at=1.0))
    await effects.apply(Place(task_id="r/a", attempt=1, node_id="n1", gpu_ids=(0,),
                              gpu_milli=1000, reason="fits"), {"n1": info("n1")}, 5.0)
    fence_key = (subjects.FENCES_BUCKET, "r.a")
    assert fence_key in bus.kv
    assert fence_key not in bus.expiring  # a running task's fence never expires
    await table.forget("r/a")
    assert (subjects.TASKS_BUCKET, "r.a") not in bus.kv
    assert bus.expiring[fence_key] == FENCE_KEPT_S
    fence = await bus.kv_get(subjects.FENCES_BUCKET, "r.a", Fence)
    assert fence is not None
    assert fence[0].attempt == 1  # still refuses attempt 0, and anything stale
    await table.store(TaskEntry(task=task("a", attempt=2), queued_at=1.0))
    await effects.apply(Place(task_id="r/a", attempt=2, node_id="n1", gpu_ids=(0,),
                              gpu_milli=1000, reason="fits"), {"n1": info("n1")}, 9.0)
    assert fence_key not in bus.expiring  # the next attempt's fence stays
    table.entries["r/a"] = TaskEntry(task=task("a", attempt=1), queued_at=1.0)
    await table.forget("r/a")  # an old attempt's end leaves the newer fence alone
    assert fence_key not in bus.expiring


async def test_a_changing_wait_reason_is_written_at_most_every_wait_store_s(
        shell: tuple[MemoryBus, Table, Effects]) -> None:
    """Found by the 10,000-task load bench: a reason quoting live figures changed nearly
    every cycle and was written to KV each time (55 writes per task, most of a cycle)."""
    bus, table, effects = shell
    await table.store(TaskEntry(task=task("w"), queued_at=0.0))
    revisions = []
    for second in range(0, 150, 2):  # a new reason every cycle of 2 s
        await effects.apply(Wait(task_id="r/w", reason=f"{second % 7} GPUs free"), {},
                            float(second))
        revisions.append(bus.kv[(subjects.TASKS_BUCKET, subjects.task_key("r/w"))][1])
        assert table.entries["r/w"].wait_reason == f"{second % 7} GPUs free"  # what the API shows
    assert len(set(revisions)) == 3  # at 0 s, 60 s and 120 s
    stored = await bus.kv_get(subjects.TASKS_BUCKET, subjects.task_key("r/w"), TaskEntry)
    assert stored is not None
    assert stored[0].wait_reason == f"{120 % 7} GPUs free"
    # a task that reads nothing is staged in memory: a restarted scheduler does it again
    await effects.apply(Stage(task_id="r/w", node_id="n1", reason="ready pool"), {}, 200.0)
    assert table.entries["r/w"].staged_nodes == ("n1",)
    assert bus.kv[(subjects.TASKS_BUCKET, subjects.task_key("r/w"))][1] == revisions[-1]


class RefusesCommands(MemoryBus):
    """A bus whose first `refusals` publishes of node commands fail, as a clustered
    JetStream's do while the commands stream elects a leader."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    async def publish(self, subject: str, message: events.Message, *,
                      msg_id: str | None = None) -> None:
        if subject.startswith(subjects.node_commands("")) and self.refusals > 0:
            self.refusals -= 1
            raise TimeoutError("no response from stream")
        await super().publish(subject, message, msg_id=msg_id)


def cool(node_id: str) -> NodeInfo:
    """A node whose GPU takes work (not throttled)."""
    return msgspec.structs.replace(info(node_id), samples=(GpuSample(
        index=0, utilization_pct=0.0, memory_used_mb=1, temperature_c=40.0),))


async def test_a_start_command_refused_after_its_placement_was_stored_is_sent_again() -> None:
    """The placement is stored, then the StartTask publish fails: the task must not wait
    for ever. It is sent again (the same message id) until its node reports it started,
    after pauses that double, and only to a live node."""
    bus = RefusesCommands(refusals=2)
    scheduler = service.Scheduler(bus, node_timeout=15.0, tick=1.0)
    scheduler.nodes = {"n1": cool("n1")}
    scheduler._saw("n1", "i", 1)
    await scheduler.table.store(TaskEntry(task=task("a"), queued_at=1.0))
    with pytest.raises(TimeoutError):  # the cycle fails (and is retried by `loop`)
        await scheduler.run_once(100.0)
    entry = scheduler.entries["r/a"]
    assert entry.placement is not None
    assert not entry.started

    def starts() -> list[events.StartTask]:
        return [m for _, m, _ in bus.published if isinstance(m, events.StartTask)]

    for now in (101.0, 105.0, 109.9):
        await scheduler.run_once(now)
    assert starts() == []  # not due yet: placed at 100
    with pytest.raises(TimeoutError):  # the second refusal: due again only after 20 s
        await scheduler.run_once(110.0)
    await scheduler.run_once(125.0)
    assert starts() == []
    await scheduler.run_once(130.0)
    assert [(m.task_id, m.attempt) for m in starts()] == [("r/a", 1)]
    ids = {msg_id for _, m, msg_id in bus.published if isinstance(m, events.StartTask)}
    assert ids == {"r/a:1:start"}  # JetStream drops a copy that had got through
    await scheduler.run_once(169.0)
    assert len(starts()) == 1  # the next one 40 s later
    await scheduler.run_once(170.0)
    assert len(starts()) == 2
    await scheduler._handle_task_event(events.TaskStarted(
        at=171.0, task_id="r/a", run_id="r", step="a", attempt=1, node_id="n1",
        pid=7, stdout_path="o", stderr_path="e"))
    await scheduler.run_once(1000.0)
    assert len(starts()) == 2  # started: never again
    assert scheduler.effects.resends == {}


async def test_a_start_command_is_not_sent_again_to_a_silent_node() -> None:
    bus = RefusesCommands(refusals=1)
    scheduler = service.Scheduler(bus, node_timeout=15.0, tick=1.0)
    scheduler.nodes = {"n1": cool("n1")}
    scheduler._saw("n1", "i", 1)
    await scheduler.table.store(TaskEntry(task=task("a"), queued_at=1.0))
    with pytest.raises(TimeoutError):
        await scheduler.run_once(100.0)
    scheduler.seen["n1"] = ("i", 1, -1e9)  # silent since long ago: it is declared lost
    await scheduler.run_once(200.0)
    assert not any(isinstance(m, events.StartTask) for _, m, _ in bus.published)
    lost = bus.of(events.TaskExited)
    assert [(e.task_id, e.cause, e.started) for e in lost] == [("r/a", "lost", False)]


async def test_staging_a_task_that_reads_inputs_asks_the_node_once_and_waits_for_its_answer(
        shell: tuple[MemoryBus, Table, Effects]) -> None:
    bus, table, effects = shell
    await table.store(TaskEntry(task=task("b", inputs=("/data/a", "/data/b")), queued_at=2.0))
    stage = Stage(task_id="r/b", node_id="n1", reason="ready pool")
    for _ in range(2):
        await effects.apply(stage, {}, 10.0)
    assert bus.kinds() == ["stage_task"]
    command = bus.published[0][1]
    assert isinstance(command, events.StageTask)
    assert (command.inputs, command.attempt) == (("/data/a", "/data/b"), 1)
    entry = table.entries["r/b"]
    assert (entry.staging_nodes, entry.staged_nodes) == (("n1",), ())  # until it answers
    # on a second node too: one command each, each node once
    for _ in range(2):
        await effects.apply(msgspec.structs.replace(stage, node_id="n2"), {}, 11.0)
    assert bus.kinds() == ["stage_task", "stage_task"]
    assert [subject for subject, _, _ in bus.published] == [
        subjects.node_commands("n1"), subjects.node_commands("n2")]
    assert table.entries["r/b"].staging_nodes == ("n1", "n2")


async def test_a_paused_task_is_continued_before_it_is_asked_to_checkpoint_and_stop(
        shell: tuple[MemoryBus, Table, Effects]) -> None:
    bus, table, effects = shell
    await table.store(TaskEntry(task=task("a"), queued_at=1.0, paused=True, placement=Placement(
        task_id="r/a", attempt=1, node_id="n1", gpu_ids=(0,), gpu_milli=1000)))
    await effects.apply(Preempt(task_id="r/a", attempt=1, reason="drain", grace_s=3.0),
                        {}, 5.0)
    assert bus.kinds() == ["resume_task", "stop_task"]


async def test_a_placement_a_newer_attempt_already_holds_is_dropped(
        shell: tuple[MemoryBus, Table, Effects]) -> None:
    bus, table, effects = shell
    await table.store(TaskEntry(task=task("a", attempt=2), queued_at=1.0))
    await effects.apply(Place(task_id="r/a", attempt=2, node_id="n1", gpu_ids=(0,),
                              gpu_milli=1000, reason="fits"), {"n1": info("n1")}, 1.0)
    await table.store(TaskEntry(task=task("a", attempt=1), queued_at=1.0))  # stale, late
    await effects.apply(Place(task_id="r/a", attempt=1, node_id="n1", gpu_ids=(0,),
                              gpu_milli=1000, reason="fits"), {"n1": info("n1")}, 2.0)
    assert bus.kinds() == ["start_task", "task_placed"]
    assert "r/a" not in table.entries


# ---------------------------------------------------------------- the decision loop


async def test_a_failing_cycle_is_logged_and_tried_again_the_service_stays_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy bug (or NATS away for a while) must not end the scheduler: the cycle is
    logged, retried after a pause that grows, and scheduling resumes once it works."""
    calls: list[float] = []
    recovered = asyncio.Event()

    def flaky(*args: Any) -> list[Decision]:
        calls.append(args[2])
        if len(calls) >= 4:
            recovered.set()
        if len(calls) <= 2:
            raise RuntimeError("policy bug")
        return []

    monkeypatch.setattr(policy, "decide", flaky)  # what service.py calls
    scheduler = service.Scheduler(MemoryBus(), node_timeout=15.0, tick=0.01)
    stop = asyncio.Event()
    with capture_logs() as logs:
        loop = asyncio.create_task(scheduler.loop(stop))
        await asyncio.wait_for(recovered.wait(), 10)
        stop.set()
        scheduler.wake.set()
        await asyncio.wait_for(loop, 5)
    failed = [e for e in logs if e["event"] == "scheduler.cycle_failed"]
    assert [e["failures"] for e in failed] == [1, 2]
    assert failed[0]["error"] == "policy bug"
    assert failed[1]["retry_in_s"] > failed[0]["retry_in_s"]  # the pause grows


async def test_a_committed_checkpoint_of_the_current_attempt_reaches_the_policy() -> None:
    """`checkpoint_committed` from the store sets the running task's last checkpoint (what
    "least work lost" counts from); one of a stale attempt changes nothing."""
    scheduler = service.Scheduler(MemoryBus(), node_timeout=15.0, tick=1.0)
    placed = Placement(task_id="r/a", attempt=2, node_id="n1", gpu_ids=(0,), gpu_milli=1000)
    await scheduler.table.store(TaskEntry(task=task("a", attempt=2), queued_at=1.0,
                                          placement=placed, started=True, started_at=10.0))

    def committed(attempt: int, at: float) -> events.CheckpointCommitted:
        return events.CheckpointCommitted(at=at, task_id="r/a", attempt=attempt,
                                          checkpoint_id=f"c-{at:.0f}")

    await scheduler._handle_task_event(committed(1, 50.0))  # the attempt before: ignored
    assert scheduler.entries["r/a"].last_checkpoint_at is None
    await scheduler._handle_task_event(committed(2, 40.0))
    await scheduler._handle_task_event(committed(2, 30.0))  # an older one, late: ignored
    (running,) = cluster_state((), {}, scheduler.entries.values()).running
    assert running.last_checkpoint_at == 40.0


# ---------------------------------------------------------------- thrash is visible


def placed(name: str, lender: str = "", **fields: Any) -> TaskEntry:
    return TaskEntry(task=task(name, preemptible=True, **fields), queued_at=1.0,
                     started=True, started_at=10.0,
                     placement=Placement(task_id=f"r/{name}", attempt=1, node_id="n1",
                                         gpu_ids=(0,), gpu_milli=1000, lender=lender))


async def test_a_preemption_is_stored_for_its_task_counted_by_kind_and_rendered(
        shell: tuple[MemoryBus, Table, Effects]) -> None:
    """The stop's task reaches the policy as `stopping_for` (its capacity counts for that
    task only); each stop sent is counted once, by kind, in the Prometheus text."""
    _, table, effects = shell
    for entry in (placed("a", preemptions=2, fruitless_preemptions=1),
                  placed("t", lender="r/a"), placed("d")):
        await table.store(entry)
    room = Preempt(task_id="r/a", attempt=1, reason="make room", grace_s=5.0, for_task="r/u")
    with capture_logs() as logs:
        for decision in (room, room,
                         Preempt(task_id="r/t", attempt=1, reason="tenant", grace_s=5.0,
                                 for_task="r/u"),
                         Preempt(task_id="r/d", attempt=1, reason="drain n1", grace_s=5.0)):
            await effects.apply(decision, {}, 20.0)
    assert table.entries["r/a"].stopping_for == "r/u"
    by_id = {r.job.task_id: r for r in cluster_state((), {}, table.entries.values()).running}
    assert (by_id["r/a"].stopping, by_id["r/a"].stopping_for) == (True, "r/u")
    assert by_id["r/d"].stopping_for == ""  # a drain frees its capacity for anyone
    assert effects.metrics.preemptions == {"preemption": 1, "backfill-tenant": 1, "drain": 1}
    text = effects.metrics.render()
    assert 'm27_scheduler_preemptions_total{kind="preemption"} 1\n' in text
    assert 'm27_scheduler_preemptions_total{kind="drain"} 1\n' in text
    assert 'm27_scheduler_decisions_total{type="preempt"} 3\n' in text
    assert 'm27_scheduler_decisions_total{type="place"} 0\n' in text
    assert "# TYPE m27_scheduler_preemptions_total counter\n" in text
    first = next(e for e in logs if e["event"] == "task.preempted")
    assert (first["kind"], first["preemptions"], first["fruitless_preemptions"],
            first["preemptions_total"]) == ("preemption", 3, 1, 1)


def test_the_thrash_counts_and_limit_reach_the_policy(tmp_path: Path) -> None:
    assert job_of(task("x", fruitless_preemptions=2)).fruitless_preemptions == 2
    settings = policy_settings(Config(scheduler=SchedulerSection(max_fruitless_preemptions=5)))
    assert settings.max_fruitless_preemptions == 5
    assert policy_settings(Config()).max_fruitless_preemptions == 3
    loaded = load_config(tmp_path / "none", environ={
        "M27_SCHEDULER_MAX_FRUITLESS_PREEMPTIONS": "0"})  # 0: no thrash protection
    assert policy_settings(loaded.config).max_fruitless_preemptions == 0


def test_the_queue_says_how_often_a_task_was_preempted_and_why_it_is_protected() -> None:
    settings = PolicySettings(min_runtime_s=60.0, max_fruitless_preemptions=3)
    young = placed("a", preemptions=4, fruitless_preemptions=3)
    message = api.entry_to_proto(young, None, api.protected(young, 40.0, settings))
    assert (message.preemptions, message.fruitless_preemptions) == (4, 3)
    assert message.protected == "computing 30 s < min runtime 60 s"
    assert "protected until it commits a checkpoint" in api.protected(young, 100.0, settings)
    checkpointed = msgspec.structs.replace(young, last_checkpoint_at=90.0)
    assert api.protected(checkpointed, 100.0, settings) == ""
    waiting = TaskEntry(task=task("w", preemptions=1), queued_at=1.0)
    assert api.protected(waiting, 100.0, settings) == ""


def test_an_entry_stored_before_staging_on_several_nodes_still_decodes() -> None:
    """The single-node `staging_on` / `staged_on` of an older scheduler are ignored (the
    task is staged again), never a decode error that loses the task."""
    old = msgspec.json.encode(TaskEntry(task=task("b"), queued_at=2.0)).replace(
        b'"staging_nodes":[]', b'"staging_on":"n1"').replace(
        b'"staged_nodes":[]', b'"staged_on":"n2"')
    assert b'"staged_on":"n2"' in old
    entry = msgspec.json.decode(old, type=TaskEntry)
    assert (entry.task.task_id, entry.staging_nodes, entry.staged_nodes) == ("r/b", (), ())


async def test_configured_windows_are_set_once_and_one_in_progress_is_left_alone() -> None:
    bus = MemoryBus()
    marks: dict[str, Maintenance] = {}
    windows = Windows(bus, lambda: marks, lambda node: 0)
    configured = parse_config("n1,n2 03:00 day -> nvidia-smi --gpu-reset")
    await windows.apply_config(configured, 1_000.0)
    assert sorted(windows.records) == ["n1", "n2"]
    first = windows.records["n1"]
    await windows.apply_config(configured, 2_000.0)  # a restart: the same windows, kept
    assert windows.records["n1"] is first
    # at its start the node is emptied (marked evacuate), then the command is sent
    assert first.next_at is not None
    await windows.tick(first.next_at)
    assert marks["n1"].evacuate
    phases = [windows.records["n1"].phase]
    await windows.tick(first.next_at + 1)  # nothing runs there: the command goes at once
    phases.append(windows.records["n1"].phase)
    assert phases == ["draining", "running"]
    commands = [m for s, m, _ in bus.published if s == subjects.node_commands("n1")]
    assert [type(m).__name__ for m in commands] == ["RunMaintenance"]
    changed = parse_config("n1 04:00 day -> true")
    await windows.apply_config(changed, first.next_at + 1)
    assert windows.records["n1"].window.at == "03:00"  # in progress: not replaced
