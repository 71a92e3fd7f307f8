"""Who may do what on the bus: one NATS user per service and per node, with exactly the
subjects its flows in docs/architecture.md need.

A pure table over `m27.common.subjects`. `m27.embedded` and `m27 credentials` turn it into
the nats-server's `authorization` block (one nkey user per principal); the server enforces
it, so a message a principal may not send never reaches the bus. What each subject of the
JetStream API means (`$JS.API.…`, `$KV.…`, `$JS.ACK.…`) is in docs/security.md.

Reading is granted more widely than writing (a service may read a whole bucket it needs a
few keys of); writing is narrowed to the keys and subjects a principal owns: a node-agent
writes only its own node record, heartbeat, events and service entry, and consumes only
its own command subject. No principal but `admin` may create, change or delete a stream,
a bucket or another service's consumer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final, Literal

import msgspec

from m27.common import events, subjects
from m27.common.model import Fence

Role = Literal["admin", "orchestrator", "scheduler", "node-agent", "checkpoint-store",
               "report", "telegram", "status"]
ROLES: Final[tuple[Role, ...]] = ("admin", "orchestrator", "scheduler", "node-agent",
                                  "checkpoint-store", "report", "telegram", "status")
#: The services' roles, each one principal per deployment (node-agents: one per node).
SERVICE_ROLES: Final[tuple[Role, ...]] = ("orchestrator", "scheduler", "checkpoint-store",
                                          "report", "telegram")
NODE_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")
API: Final = "$JS.API"


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    """Subjects a principal may publish to and subscribe to (NATS wildcards)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    #: May answer a request it received, on the request's reply subject, once (NATS
    #: `allow_responses`): how the orchestrator hands a node its step's secret values
    #: without being allowed to publish to any inbox.
    allow_responses: bool = False


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    role: Role
    node_id: str = ""  # node-agents only

    @property
    def name(self) -> str:
        """The user's name on the bus, and its sender token on task events: the role, or
        `node-<id>` for a node-agent."""
        return subjects.node_sender(self.node_id) if self.role == "node-agent" else self.role

    @property
    def inbox(self) -> str:
        """This principal's reply subjects: nobody else can read its replies."""
        return "_INBOX_" + self.name


def principal(role: Role, node_id: str = "") -> Principal:
    """A principal; ValueError when a node-agent has no valid node id, or another role one."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    if role == "node-agent":
        if not NODE_ID.fullmatch(node_id):
            raise ValueError(f"a node-agent needs a node id matching {NODE_ID.pattern}, "
                             f"got {node_id!r}")
    elif node_id:
        raise ValueError(f"only node-agents have a node id (role {role!r})")
    return Principal(role=role, node_id=node_id)


def deployment(node_ids: Iterable[str]) -> list[Principal]:
    """Every principal of a deployment whose node-agents have these ids: the admin, the
    status reader, each service, each node; ValueError names a bad node id."""
    return [principal("admin"), principal("status"),
            *(principal(role) for role in SERVICE_ROLES),
            *(principal("node-agent", node) for node in node_ids)]


def service_principal(service: str, node_id: str = "") -> Principal:
    """The principal a service process connects as (`service` as in m27_services keys)."""
    if service not in ROLES or service in ("admin", "status"):
        raise ValueError(f"{service!r} is not a service (services: "
                         f"{', '.join((*SERVICE_ROLES, 'node-agent'))})")
    return principal(service, node_id)


def kv_read(bucket: str, key: str = ">") -> tuple[str, ...]:
    """Bind to a bucket, list its keys, get a value."""
    stream = f"KV_{bucket}"
    return (f"{API}.STREAM.INFO.{stream}", f"{API}.STREAM.MSG.GET.{stream}",
            f"{API}.DIRECT.GET.{stream}", f"{API}.DIRECT.GET.{stream}.$KV.{bucket}.{key}")


def streams_seen(role: Role) -> tuple[str, ...]:
    """The streams (buckets' included) `role` may look up: a bucket marked `visible_to`
    only by those roles."""
    return (*(stream.name for stream in subjects.STREAMS),
            *(f"KV_{b.name}" for b in subjects.BUCKETS
              if not b.visible_to or role in b.visible_to or role == "admin"))


def kv_write(bucket: str, key: str = ">") -> tuple[str, ...]:
    """Put, compare-and-set and delete under `key` (a pattern) of a bucket."""
    return (f"$KV.{bucket}.{key}",)


def durable_consumer(stream: str, name: str, filter_subject: str) -> tuple[str, ...]:
    """Create (with this very filter: the server checks it against the request), look up,
    pull from and acknowledge one durable consumer."""
    return (f"{API}.CONSUMER.CREATE.{stream}.{name}.{filter_subject}",
            f"{API}.CONSUMER.INFO.{stream}.{name}",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"$JS.ACK.{stream}.{name}.>",
            subjects.dead_letter(name))


def ordered_consumers(stream: str) -> tuple[str, ...]:
    """Ephemeral ordered consumers (`WatchRun`): create (the server refuses a durable name
    on this subject), look up, answer flow control. They expire by themselves; deleting
    one would also allow deleting another service's durable consumer."""
    return (f"{API}.STREAM.NAMES", f"{API}.CONSUMER.CREATE.{stream}",
            f"{API}.CONSUMER.INFO.{stream}.>", f"$JS.FC.{stream}.>")


def service_entry(service: str, instance: str = "*") -> tuple[str, ...]:
    """Register in m27_services under `<service>.<instance>` and read the others."""
    return (*kv_write(subjects.SERVICES_BUCKET, subjects.service_key(service, instance)),
            *kv_read(subjects.SERVICES_BUCKET))


def permissions(who: Principal) -> Permissions:
    """What `who` may publish and subscribe to; see the module's docstring."""
    inbox = (f"{who.inbox}.>",)
    # Every service checks at start that the streams and buckets exist (read-only).
    look = tuple(f"{API}.STREAM.INFO.{name}" for name in streams_seen(who.role))
    event_stream, command_stream = subjects.EVENTS_STREAM, subjects.COMMANDS_STREAM
    publish: tuple[str, ...]
    subscribe: tuple[str, ...] = inbox
    if who.role == "admin":
        return Permissions(publish=(">",), subscribe=(">",))
    if who.role == "status":
        publish = look
    elif who.role == "orchestrator":
        publish = (
            *look,
            subjects.RUN_STATE_ALL, f"{subjects.PREFIX}.events.run.*.step.*",
            subjects.SCHEDULER_COMMANDS,
            *kv_write(subjects.RUNS_BUCKET), *kv_read(subjects.RUNS_BUCKET),
            *kv_write(subjects.CACHE_BUCKET), *kv_read(subjects.CACHE_BUCKET),
            *kv_read(subjects.NODES_BUCKET), *kv_read(subjects.TASKS_BUCKET),
            *kv_read(subjects.MAINTENANCE_BUCKET), *kv_read(subjects.FENCES_BUCKET),
            *kv_write(subjects.SECRETS_BUCKET), *kv_read(subjects.SECRETS_BUCKET),
            *service_entry("orchestrator"),
            *durable_consumer(event_stream, subjects.ORCHESTRATOR_TASK_EVENTS,
                              subjects.TASK_EVENTS_ALL),
            *durable_consumer(event_stream, subjects.ORCHESTRATOR_REPORTS, subjects.RUN_REPORT_ALL),
            *ordered_consumers(event_stream),
        )
        subscribe = (*inbox, subjects.SECRETS_REQUEST)
        return Permissions(publish=publish, subscribe=subscribe, allow_responses=True)
    elif who.role == "scheduler":
        publish = (
            *look,
            f"{subjects.PREFIX}.cmd.node.*",
            subjects.task_events("*", "*", subjects.SCHEDULER_SENDER),
            subjects.NODE_EVENTS_ALL,
            *kv_write(subjects.TASKS_BUCKET), *kv_read(subjects.TASKS_BUCKET),
            *kv_write(subjects.FENCES_BUCKET), *kv_read(subjects.FENCES_BUCKET),
            *kv_write(subjects.MAINTENANCE_BUCKET), *kv_read(subjects.MAINTENANCE_BUCKET),
            *kv_write(subjects.WINDOWS_BUCKET), *kv_read(subjects.WINDOWS_BUCKET),
            *kv_read(subjects.NODES_BUCKET),
            *kv_write(subjects.LEASES_BUCKET, "scheduler"), *kv_read(subjects.LEASES_BUCKET),
            *service_entry("scheduler"),
            *durable_consumer(command_stream, subjects.SCHEDULER_COMMAND_CONSUMER,
                              subjects.SCHEDULER_COMMANDS),
            *durable_consumer(event_stream, subjects.SCHEDULER_TASK_EVENTS,
                              subjects.TASK_EVENTS_ALL),
        )
        subscribe = (*inbox, subjects.HEARTBEAT_ALL, subjects.NODE_EVENTS_ALL)
    elif who.role == "node-agent":
        node = who.node_id
        publish = (
            *look,
            subjects.task_events("*", "*", who.name), subjects.node_events(node),
            subjects.heartbeat(node), subjects.metrics("*", "*", who.name),
            subjects.telemetry(who.name),
            *kv_write(subjects.NODES_BUCKET, node), *kv_read(subjects.NODES_BUCKET),
            *kv_read(subjects.FENCES_BUCKET), subjects.SECRETS_REQUEST,
            *service_entry("node-agent", node),
            *durable_consumer(command_stream, subjects.node_command_consumer(node),
                              subjects.node_commands(node)),
        )
    elif who.role == "checkpoint-store":
        publish = (
            *look,
            subjects.task_events("*", "*", subjects.CHECKPOINT_STORE_SENDER),
            *kv_write(subjects.CHECKPOINTS_BUCKET), *kv_read(subjects.CHECKPOINTS_BUCKET),
            *kv_read(subjects.FENCES_BUCKET),
            *kv_read(subjects.RUNS_BUCKET),  # when a run ended: `[checkpoint] keep_finished`
            *service_entry("checkpoint-store"),
        )
    elif who.role == "telegram":
        publish = (
            *look,
            *kv_write(subjects.SUBSCRIPTIONS_BUCKET), *kv_read(subjects.SUBSCRIPTIONS_BUCKET),
            *service_entry("telegram"),
        )
    else:  # report
        publish = (
            *look,
            subjects.RUN_REPORT_ALL,
            *service_entry("report"),
            *durable_consumer(event_stream, subjects.REPORT_NOTIFY, subjects.EVENTS_ALL),
            *durable_consumer(subjects.TELEMETRY_STREAM, subjects.REPORT_NOTIFY_TELEMETRY,
                              subjects.TELEMETRY_ALL),
            *kv_read(subjects.SUBSCRIPTIONS_BUCKET), *kv_read(subjects.TASKS_BUCKET),
            *kv_write(subjects.NOTIFIED_BUCKET), *kv_read(subjects.NOTIFIED_BUCKET),
            *kv_read(subjects.FENCES_BUCKET),
            # Each copy reads what it materialises itself (report.replica), from its own
            # position: ordered consumers, which take no message from anyone else.
            *ordered_consumers(event_stream), *ordered_consumers(subjects.METRICS_STREAM),
            *ordered_consumers(subjects.TELEMETRY_STREAM),
        )
        subscribe = (*inbox, subjects.EVENTS_ALL)  # the dashboard's recent events (core)
    return Permissions(publish=publish, subscribe=subscribe)


def sender_problem(subject: str, event: events.Event, fence: Fence | None) -> str | None:
    """Why a task event on `subject` cannot be what it claims, or None when it can.

    The sender is the subject's last token, which the server lets each principal publish
    only as itself. A node's report (started, exited, idle, busy, staged, over its share)
    must come from the node it names, and that node must be the one the task's fence
    (`fence`, the current assignment) gives the attempt to; `task_placed` comes from the
    scheduler, which also reports the exit of a task on a lost node; checkpoint events come
    from the checkpoint-store. A subject without a sender (a bus without users, or an
    event stored before senders were added) is taken as it is.
    """
    tokens = subject.split(".")
    if len(tokens) == 5:
        return None
    if len(tokens) != 6 or tokens[:3] != [subjects.PREFIX, "events", "task"]:
        return f"not a task event subject: {subject!r}"
    run_id, step, sender = tokens[3], tokens[4], tokens[5]
    task_id = getattr(event, "task_id", "")
    if task_id != f"{run_id}/{step}":
        return f"{events.tag_of(event)} for {str(task_id)[:200]!r} sent on {subject}"
    allowed = _senders(event)
    if sender not in allowed:
        return (f"{events.tag_of(event)} of {task_id} sent by {sender!r}; only "
                f"{' or '.join(repr(a) for a in allowed)} may send it")
    node_id = getattr(event, "node_id", None)
    if (sender.startswith("node-") and fence is not None and node_id is not None
            and fence.attempt == getattr(event, "attempt", None) and fence.node_id != node_id):
        return (f"{events.tag_of(event)} of {task_id} attempt {fence.attempt} from node "
                f"{node_id!r}, but that attempt runs on {fence.node_id!r}")
    return None


def metrics_problem(subject: str, batch: events.MetricPoints, fence: Fence | None = None
                    ) -> str | None:
    """Why metric points on `subject` cannot be what they claim, or None when they can:
    they must name the run, step and task of their subject, and come from the node they
    name (the subject's last token, which only that node may publish); and when the task's
    fence (`fence`, its current assignment) is of the same attempt, from the node it gives
    that attempt to. (An older attempt's points, read again when the history is rebuilt,
    cannot be judged by today's fence and are taken.)"""
    expected = subjects.metrics(batch.run_id, batch.step, subjects.node_sender(batch.node_id))
    if subject != expected or batch.task_id != f"{batch.run_id}/{batch.step}":
        return (f"metric_points of {batch.task_id[:200]!r} from node {batch.node_id[:100]!r} "
                f"sent on {subject[:300]}")
    if fence is not None and fence.attempt == batch.attempt and fence.node_id != batch.node_id:
        return (f"metric_points of {batch.task_id} attempt {batch.attempt} from node "
                f"{batch.node_id!r}, but that attempt runs on {fence.node_id!r}")
    return None


def telemetry_problem(subject: str, message: events.GpuTelemetry) -> str | None:
    """Why GPU telemetry on `subject` cannot be what it claims (its node must be the
    subject's sender, which only that node may publish), or None."""
    if subject != subjects.telemetry(subjects.node_sender(message.node_id)):
        return f"gpu_telemetry of node {message.node_id[:100]!r} sent on {subject[:300]}"
    return None


def _senders(event: events.Event) -> tuple[str, ...]:
    match event:
        case events.TaskPlaced():
            return (subjects.SCHEDULER_SENDER,)
        case events.TaskExited():
            return (subjects.node_sender(event.node_id), subjects.SCHEDULER_SENDER)
        case (events.TaskStarted() | events.TaskIdle() | events.TaskBusy() | events.TaskStaged()
              | events.TaskOverShare() | events.TrainingAnomaly()):
            return (subjects.node_sender(event.node_id),)
        case events.CheckpointCommitted() | events.CheckpointCorrupt():
            return (subjects.CHECKPOINT_STORE_SENDER,)
    return ()
