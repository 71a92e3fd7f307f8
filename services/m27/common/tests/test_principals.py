"""The bus's permission table, read as NATS reads it: what each principal's subjects let it
publish, and which task events a consumer takes as sent by whom they claim."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common import events, subjects
from m27.common.memory_bus import subject_matches as matches
from m27.common.model import Fence
from m27.common.principals import (
    ROLES,
    Principal,
    metrics_problem,
    permissions,
    principal,
    sender_problem,
    telemetry_problem,
)

node_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,20}", fullmatch=True)
NON_ADMIN = [principal(role) for role in ROLES if role not in ("admin", "node-agent")]
NODE = principal("node-agent", "gpu-1")
EVERYONE = [*NON_ADMIN, NODE]


def may_publish(who: Principal, subject: str) -> bool:
    return any(matches(pattern, subject) for pattern in permissions(who).publish)


def test_the_matcher_reads_wildcards_as_nats_does() -> None:
    assert matches("a.*.c", "a.b.c")
    assert not matches("a.*.c", "a.b.c.d")
    assert matches("a.>", "a.b.c")
    assert not matches("a.>", "a")
    assert not matches("a.b", "a.b.c")


def test_nobody_but_the_admin_may_change_delete_or_purge_a_stream_or_bucket() -> None:
    admin_only = [f"$JS.API.STREAM.{verb}.{name}"
                  for verb in ("CREATE", "UPDATE", "DELETE", "PURGE")
                  for name in ("M27_EVENTS", "M27_COMMANDS", "M27_DEAD", "KV_m27_runs",
                               "KV_m27_fences")]
    admin_only += ["$JS.API.CONSUMER.DELETE.M27_COMMANDS.node-gpu-1",
                   "$JS.API.CONSUMER.DELETE.M27_EVENTS.scheduler-task-events",
                   "$JS.API.STREAM.MSG.DELETE.M27_EVENTS", "$JS.API.ACCOUNT.PURGE.x"]
    for who in EVERYONE:
        assert not [s for s in admin_only if may_publish(who, s)], who.name
    assert all(may_publish(principal("admin"), s) for s in admin_only)


def test_each_record_and_command_has_exactly_its_one_writer() -> None:
    writers = {
        "$KV.m27_runs.r-1": {"orchestrator"},
        "$KV.m27_cache.abc": {"orchestrator"},
        "$KV.m27_fences.r-1.train": {"scheduler"},
        "$KV.m27_tasks.r-1.train": {"scheduler"},
        "$KV.m27_maintenance.gpu-1": {"scheduler"},
        "$KV.m27_checkpoints.r-1.train.c1": {"checkpoint-store"},
        "$KV.m27_nodes.gpu-1": {"node-gpu-1"},
        "m27.cmd.node.gpu-1": {"scheduler"},
        "m27.cmd.scheduler": {"orchestrator"},
        "m27.events.run.r-1.state": {"orchestrator"},
        "m27.events.run.r-1.step.train": {"orchestrator"},
        "m27.events.run.r-1.report": {"report"},
        "m27.heartbeat.gpu-1": {"node-gpu-1"},
        "$KV.m27_secrets.r-1.0.abc": {"orchestrator"},
        subjects.SECRETS_REQUEST: {"node-gpu-1"},
        subjects.metrics("r-1", "train", "node-gpu-1"): {"node-gpu-1"},
        subjects.telemetry("node-gpu-1"): {"node-gpu-1"},
        subjects.task_events("r-1", "train", "node-gpu-1"): {"node-gpu-1"},
        subjects.task_events("r-1", "train", "scheduler"): {"scheduler"},
        subjects.task_events("r-1", "train", "checkpoint-store"): {"checkpoint-store"},
    }
    for subject, expected in writers.items():
        assert {who.name for who in EVERYONE if may_publish(who, subject)} == expected, subject


def test_no_one_but_the_scheduler_and_the_admin_may_subscribe_to_heartbeats() -> None:
    """Core subscriptions beyond a principal's own inbox: the scheduler's heartbeats and
    node events, the orchestrator's secrets requests, and the report's events (the
    dashboard's recent events: what every event subscriber may read) — nothing else."""
    for who in EVERYONE:
        allowed = permissions(who).subscribe
        assert all(s.startswith(who.inbox + ".") or who.role == "scheduler"
                   or (who.role, s) == ("orchestrator", subjects.SECRETS_REQUEST)
                   or (who.role, s) == ("report", subjects.EVENTS_ALL)
                   for s in allowed), who.name
    hearing = {who.name for who in EVERYONE if may_subscribe(who, subjects.heartbeat("gpu-1"))}
    assert hearing == {"scheduler"}


def may_subscribe(who: Principal, subject: str) -> bool:
    return any(matches(pattern, subject) for pattern in permissions(who).subscribe)


def test_only_the_orchestrator_may_read_the_secrets_bucket_or_hear_requests_for_it() -> None:
    """Reading a value (by key or sequence, or by a wildcard filter on the direct-get
    subject, which JetStream serves as the last match), looking at the bucket's stream
    (its info lists the keys), or overhearing a put or a secrets request."""
    reads = ["$JS.API.STREAM.MSG.GET.KV_m27_secrets", "$JS.API.DIRECT.GET.KV_m27_secrets",
             "$JS.API.DIRECT.GET.KV_m27_secrets.$KV.m27_secrets.>",
             "$JS.API.DIRECT.GET.KV_m27_secrets.$KV.m27_secrets.r-1.0.abc",
             "$JS.API.STREAM.INFO.KV_m27_secrets",
             "$JS.API.CONSUMER.CREATE.KV_m27_secrets",
             "$JS.API.CONSUMER.CREATE.KV_m27_secrets.x.$KV.m27_secrets.>"]
    for who in EVERYONE:
        allowed = {s for s in reads if may_publish(who, s)}
        if who.role == "orchestrator":
            assert allowed >= set(reads[:5]), allowed
        else:
            assert not allowed, who.name
        assert may_subscribe(who, "$KV.m27_secrets.r-1.0.abc") is False, who.name
        assert may_subscribe(who, subjects.SECRETS_REQUEST) == (who.role == "orchestrator")
        # it answers on the asker's reply subject only, never publishes to an inbox
        assert permissions(who).allow_responses == (who.role == "orchestrator")
        assert not may_publish(who, "_INBOX_node-gpu-1.x")


@given(node_ids, node_ids)
def test_only_a_nodes_own_inbox_names_it(mine: str, other: str) -> None:
    """The orchestrator answers a secrets request on its reply subject and takes the
    inbox's node as the asker: only that node may subscribe to it."""
    inbox = principal("node-agent", mine).inbox
    assert subjects.inbox_node(f"{inbox}.abc") == mine
    assert subjects.inbox_node(inbox) is None
    assert subjects.inbox_node("_INBOX_orchestrator.x") is None
    if mine != other:
        assert not may_subscribe(principal("node-agent", other), f"{inbox}.abc")
    assert not any(may_subscribe(who, f"{inbox}.abc") for who in NON_ADMIN)


@given(node_ids, node_ids)
def test_a_node_can_speak_only_for_itself(mine: str, other: str) -> None:
    if mine == other:
        return
    me = principal("node-agent", mine)
    theirs = [subjects.node_commands(other), subjects.node_commands(mine),
              subjects.heartbeat(other), subjects.node_events(other),
              f"$KV.{subjects.NODES_BUCKET}.{other}",
              subjects.task_events("r-1", "train", subjects.node_sender(other)),
              subjects.task_events("r-1", "train", subjects.SCHEDULER_SENDER),
              subjects.metrics("r-1", "train", subjects.node_sender(other)),
              subjects.telemetry(subjects.node_sender(other)),
              f"$KV.{subjects.SERVICES_BUCKET}.node-agent.{other}",
              f"$JS.API.CONSUMER.CREATE.M27_COMMANDS.node-{mine}.m27.cmd.node.{other}",
              f"$JS.API.CONSUMER.MSG.NEXT.M27_COMMANDS.node-{other}"]
    assert not [s for s in theirs if may_publish(me, s)]
    own = [subjects.heartbeat(mine), subjects.node_events(mine),
           f"$KV.{subjects.NODES_BUCKET}.{mine}",
           subjects.task_events("r-1", "train", subjects.node_sender(mine)),
           subjects.metrics("r-1", "train", subjects.node_sender(mine)),
           subjects.telemetry(subjects.node_sender(mine)),
           f"$JS.API.CONSUMER.MSG.NEXT.M27_COMMANDS.node-{mine}"]
    assert all(may_publish(me, s) for s in own)


@pytest.mark.parametrize(("role", "node_id", "why"), [
    ("node-agent", "a.b", "needs a node id"), ("node-agent", "", "needs a node id"),
    ("scheduler", "n1", "only node-agents"), ("root", "", "unknown role")])
def test_a_principal_is_refused_a_bad_role_or_node_id(role: str, node_id: str,
                                                      why: str) -> None:
    with pytest.raises(ValueError, match=why):
        principal(role, node_id)  # type: ignore[arg-type]


def exited(node_id: str, attempt: int = 2) -> events.TaskExited:
    return events.TaskExited(at=1.0, task_id="r-1/train", run_id="r-1", step="train",
                             attempt=attempt, node_id=node_id, exit_code=0, started=True)


def test_a_node_report_must_come_from_the_node_the_attempt_runs_on() -> None:
    fence = Fence(task_id="r-1/train", attempt=2, node_id="gpu-1", at=0.0)
    on = subjects.task_events
    assert sender_problem(on("r-1", "train", "node-gpu-1"), exited("gpu-1"), fence) is None
    # the scheduler reports the exits of tasks on lost nodes
    assert sender_problem(on("r-1", "train", "scheduler"), exited("gpu-1"), fence) is None
    forged = {
        "another node, as itself": (on("r-1", "train", "node-gpu-2"), exited("gpu-2")),
        "another node, as the victim": (on("r-1", "train", "node-gpu-2"), exited("gpu-1")),
        "the report service": (on("r-1", "train", "report"), exited("gpu-1")),
        "another task's subject": (on("r-9", "train", "node-gpu-1"), exited("gpu-1")),
    }
    for what, (subject, event) in forged.items():
        problem = sender_problem(subject, event, fence)
        assert problem, what
    # an older attempt is the consumers' stale-attempt check, not a forgery
    assert sender_problem(on("r-1", "train", "node-gpu-2"), exited("gpu-2", 1), fence) is None
    placed = events.TaskPlaced(at=1.0, task_id="r-1/train", run_id="r-1", step="train",
                               attempt=2, node_id="gpu-1", gpu_ids=(0,))
    assert sender_problem(on("r-1", "train", "node-gpu-1"), placed, fence)
    committed = events.CheckpointCommitted(at=1.0, task_id="r-1/train", attempt=2,
                                           checkpoint_id="c")
    assert sender_problem(on("r-1", "train", "checkpoint-store"), committed, None) is None
    assert sender_problem(on("r-1", "train", "node-gpu-1"), committed, None)
    anomaly = events.TrainingAnomaly(at=1.0, task_id="r-1/train", run_id="r-1", step="train",
                                     attempt=2, node_id="gpu-1", kind="nan", metric="loss",
                                     train_step=7, value="NaN")
    assert sender_problem(on("r-1", "train", "node-gpu-1"), anomaly, fence) is None
    assert sender_problem(on("r-1", "train", "node-gpu-2"), anomaly, fence)
    assert sender_problem(on("r-1", "train", "scheduler"), anomaly, fence)


def test_metric_points_must_come_from_the_node_they_name() -> None:
    batch = events.MetricPoints(at=0.0, task_id="r-1/train", run_id="r-1", step="train",
                                attempt=1, node_id="gpu-1", offset=0, points=())
    assert metrics_problem(subjects.metrics("r-1", "train", "node-gpu-1"), batch) is None
    for subject in (subjects.metrics("r-1", "train", "node-gpu-2"),  # another node's name
                    subjects.metrics("r-2", "train", "node-gpu-1"),  # another run
                    "m27.metrics.r-1.train"):
        assert metrics_problem(subject, batch)
    wrong_task = msgspec.structs.replace(batch, task_id="r-1/other")
    assert metrics_problem(subjects.metrics("r-1", "train", "node-gpu-1"), wrong_task)
    # the task's fence gives this attempt to another node: gpu-1 does not run it
    here = subjects.metrics("r-1", "train", "node-gpu-1")
    moved = Fence(task_id="r-1/train", attempt=1, node_id="gpu-2", at=0.0)
    assert metrics_problem(here, batch, moved)
    assert metrics_problem(here, batch, msgspec.structs.replace(moved, node_id="gpu-1")) is None
    # a later attempt elsewhere: this one's points were logged when it ran here
    assert metrics_problem(here, batch, msgspec.structs.replace(moved, attempt=2)) is None


def test_gpu_telemetry_must_come_from_the_node_it_names() -> None:
    reading = events.GpuTelemetry(at=0.0, node_id="gpu-1", incarnation="i", seq=1,
                                  backend="simulated")
    assert telemetry_problem(subjects.telemetry("node-gpu-1"), reading) is None
    for subject in (subjects.telemetry("node-gpu-2"), "m27.telemetry", "m27.telemetry.x.y"):
        assert telemetry_problem(subject, reading)
