"""NATS subjects, JetStream streams, consumers and KV buckets: the bus contract, in one place.

docs/architecture.md draws these; change both together.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

# ---------------------------------------------------------------- subjects

PREFIX: Final = "m27"

#: Every event stored in the events stream.
EVENTS_ALL: Final = f"{PREFIX}.events.>"
#: Run-level events (submitted, state changed) of every run.
RUN_STATE_ALL: Final = f"{PREFIX}.events.run.*.state"
#: Report announcements of every run.
RUN_REPORT_ALL: Final = f"{PREFIX}.events.run.*.report"
#: Task events (placed, started, exited) of every task.
TASK_EVENTS_ALL: Final = f"{PREFIX}.events.task.>"
#: Node events (registered, stopped, lost) of every node.
NODE_EVENTS_ALL: Final = f"{PREFIX}.events.node.*"
#: Heartbeats travel on core NATS only: frequent, and only the latest matters.
HEARTBEAT_ALL: Final = f"{PREFIX}.heartbeat.*"
#: Every command stored in the commands stream.
COMMANDS_ALL: Final = f"{PREFIX}.cmd.>"
#: Commands for the scheduler (enqueue, cancel).
SCHEDULER_COMMANDS: Final = f"{PREFIX}.cmd.scheduler"
#: A node-agent asks the orchestrator for a step's secret environment values (core NATS
#: request/reply: never stored). The answer goes to the asker's reply subject, which only
#: that node can read (its inbox, `principals.Principal.inbox`).
SECRETS_REQUEST: Final = f"{PREFIX}.secrets.get"
#: The prefix of every node-agent's reply subjects: `_INBOX_node-<node_id>.…`.
NODE_INBOX_PREFIX: Final = "_INBOX_node-"


def inbox_node(reply: str) -> str | None:
    """The node whose inbox `reply` is, or None: not a node's."""
    head, dot, _ = reply.partition(".")
    if not dot or not head.startswith(NODE_INBOX_PREFIX):
        return None
    return head[len(NODE_INBOX_PREFIX):] or None


#: Training metrics of every step (`metrics`), in their own stream.
METRICS_ALL: Final = f"{PREFIX}.metrics.>"


def metrics(run_id: str, step: str, sender: str) -> str:
    """A step's metric points, as `sender` (its node, `node_sender`) published them; each
    node may publish only as itself, like task events."""
    return f"{PREFIX}.metrics.{run_id}.{step}.{sender}"


#: Every node's GPU telemetry (`telemetry`), in its own stream.
TELEMETRY_ALL: Final = f"{PREFIX}.telemetry.*"


def telemetry(sender: str) -> str:
    """A node's GPU readings, as that node (`node_sender`) published them."""
    return f"{PREFIX}.telemetry.{sender}"


def run_events(run_id: str) -> str:
    """Everything about one run: its state, its steps, its report."""
    return f"{PREFIX}.events.run.{run_id}.>"


def run_state(run_id: str) -> str:
    return f"{PREFIX}.events.run.{run_id}.state"


def step_state(run_id: str, step: str) -> str:
    return f"{PREFIX}.events.run.{run_id}.step.{step}"


def run_report(run_id: str) -> str:
    return f"{PREFIX}.events.run.{run_id}.report"


#: Who sent a task event: the last token of its subject. The bus's permissions
#: (`m27.common.principals`) let each sender publish only under its own name, so a
#: consumer can tell a node's `task_exited` from a forged one (`principals.sender_problem`).
SCHEDULER_SENDER: Final = "scheduler"
CHECKPOINT_STORE_SENDER: Final = "checkpoint-store"


def node_sender(node_id: str) -> str:
    """A node-agent's name as a sender (and as a NATS user): `node-<node_id>`."""
    return f"node-{node_id}"


def task_events(run_id: str, step: str, sender: str) -> str:
    """One task's events as `sender` publishes them (`node_sender(...)`, SCHEDULER_SENDER,
    CHECKPOINT_STORE_SENDER)."""
    return f"{PREFIX}.events.task.{run_id}.{step}.{sender}"


def task_events_of(run_id: str, step: str) -> str:
    """One task's events, whoever sent them."""
    return f"{PREFIX}.events.task.{run_id}.{step}.>"


def node_events(node_id: str) -> str:
    return f"{PREFIX}.events.node.{node_id}"


def heartbeat(node_id: str) -> str:
    return f"{PREFIX}.heartbeat.{node_id}"


def node_commands(node_id: str) -> str:
    return f"{PREFIX}.cmd.node.{node_id}"


# ---------------------------------------------------------------- streams

EVENTS_STREAM: Final = "M27_EVENTS"
COMMANDS_STREAM: Final = "M27_COMMANDS"
DEAD_STREAM: Final = "M27_DEAD"
METRICS_STREAM: Final = "M27_METRICS"
TELEMETRY_STREAM: Final = "M27_TELEMETRY"
DEAD_ALL: Final = f"{PREFIX}.dead.>"


def dead_letter(consumer: str) -> str:
    """Where a message no handler of `consumer` could take is kept (`m27 status` counts
    them; the original subject and the error are in its headers)."""
    return f"{PREFIX}.dead.{consumer}"

DAY: Final = 86400.0


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    subjects: tuple[str, ...]
    retention: Literal["limits", "workqueue"]
    max_age_s: float
    description: str
    duplicate_window_s: float = 120.0


STREAMS: Final[tuple[StreamSpec, ...]] = (
    StreamSpec(
        name=EVENTS_STREAM,
        subjects=(EVENTS_ALL,),
        retention="limits",
        max_age_s=30 * DAY,
        description="What happened: run, step, task and node events (JSON).",
    ),
    StreamSpec(
        name=COMMANDS_STREAM,
        subjects=(COMMANDS_ALL,),
        retention="workqueue",
        max_age_s=7 * DAY,
        description="What to do: commands to the scheduler and to each node-agent; "
        "a message is removed once its consumer acks it.",
    ),
    StreamSpec(
        name=DEAD_STREAM,
        subjects=(DEAD_ALL,),
        retention="limits",
        max_age_s=30 * DAY,
        description="Dead letters: messages a consumer rejected as malformed or failed on "
        "again and again, kept with the reason instead of being retried forever.",
    ),
    StreamSpec(
        name=METRICS_STREAM,
        subjects=(METRICS_ALL,),
        retention="limits",
        max_age_s=30 * DAY,
        description="Training metrics: the points each step's program logged, as its "
        "node-agent read them (metric_points, JSON).",
    ),
    StreamSpec(
        name=TELEMETRY_STREAM,
        subjects=(TELEMETRY_ALL,),
        retention="limits",
        # A heartbeat's readings of 8 GPUs are about 2 KB: 35 MB per node and day.
        max_age_s=7 * DAY,
        description="GPU telemetry: every node's GPU readings at each heartbeat and who "
        "held what (gpu_telemetry, JSON).",
    ),
)

# ---------------------------------------------------------------- durable consumers

ORCHESTRATOR_TASK_EVENTS: Final = "orchestrator-task-events"
ORCHESTRATOR_REPORTS: Final = "orchestrator-reports"
SCHEDULER_COMMAND_CONSUMER: Final = "scheduler-commands"
SCHEDULER_TASK_EVENTS: Final = "scheduler-task-events"
#: Notifications (the report service's notifier): every event, matched against the rules.
REPORT_NOTIFY: Final = "report-notify"
#: ... and the GPU readings, for too-hot GPUs.
REPORT_NOTIFY_TELEMETRY: Final = "report-notify-telemetry"


def node_command_consumer(node_id: str) -> str:
    return f"node-{node_id}"


# ---------------------------------------------------------------- KV buckets

RUNS_BUCKET: Final = "m27_runs"
NODES_BUCKET: Final = "m27_nodes"
TASKS_BUCKET: Final = "m27_tasks"
SERVICES_BUCKET: Final = "m27_services"
CHECKPOINTS_BUCKET: Final = "m27_checkpoints"
CACHE_BUCKET: Final = "m27_cache"
FENCES_BUCKET: Final = "m27_fences"
MAINTENANCE_BUCKET: Final = "m27_maintenance"
WINDOWS_BUCKET: Final = "m27_windows"
SECRETS_BUCKET: Final = "m27_secrets"
SUBSCRIPTIONS_BUCKET: Final = "m27_subscriptions"
LEASES_BUCKET: Final = "m27_leases"
NOTIFIED_BUCKET: Final = "m27_notified"
#: How long a delivered notification is remembered (a redelivery older than this could be
#: sent again; the events stream keeps 30 days, but a consumer is never that far behind).
NOTIFIED_TTL_S: Final = 7 * 86400.0
#: How long a run's secret values are kept at most (they are deleted sooner, when the
#: run succeeds): a failed or cancelled run can be retried within this time.
SECRETS_TTL_S: Final = 30 * 86400.0


class BucketSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str
    history: int = 1
    max_value_size: int = 4 * 1024 * 1024
    ttl_s: float | None = None  # entries expire after this long
    #: Roles that may look at the bucket's stream (its info lists the keys); () for all.
    visible_to: tuple[str, ...] = ()


BUCKETS: Final[tuple[BucketSpec, ...]] = (
    BucketSpec(
        name=RUNS_BUCKET,
        description="Orchestrator: run_id → the run with every step's state and its outbox.",
        max_value_size=8 * 1024 * 1024,
    ),
    BucketSpec(
        name=NODES_BUCKET, description="node_id → what the node registered, last heartbeat."
    ),
    BucketSpec(
        name=TASKS_BUCKET,
        description="Scheduler: queued and placed tasks (key: run_id.step).",
    ),
    BucketSpec(name=SERVICES_BUCKET, description="service.instance → gRPC address, pid, host."),
    BucketSpec(
        name=FENCES_BUCKET,
        description="Scheduler: run_id.step → the attempt (and node) allowed to run a task "
        "and write its checkpoints; compare-and-set, attempts only grow.",
    ),
    BucketSpec(
        name=CACHE_BUCKET,
        description="Orchestrator: step cache key → the earlier step and its output digests.",
    ),
    BucketSpec(
        name=CHECKPOINTS_BUCKET,
        description="Checkpoint-store: run_id.step.checkpoint_id → checkpoint record.",
    ),
    BucketSpec(
        name=MAINTENANCE_BUCKET,
        description="Scheduler: node_id → cordoned or draining (m27 node cordon|drain).",
    ),
    BucketSpec(
        name=WINDOWS_BUCKET,
        description="Scheduler: node_id → its maintenance window (m27 node maintain) and "
        "where the window stands (scheduled, draining, running).",
        max_value_size=64 * 1024,
    ),
    BucketSpec(
        name=SECRETS_BUCKET,
        description="Orchestrator (alone): run_id.set.nonce → one set of a run's secret "
        "environment values; node-agents ask for a step's on SECRETS_REQUEST.",
        max_value_size=512 * 1024, ttl_s=SECRETS_TTL_S, visible_to=("orchestrator",),
    ),
    BucketSpec(
        name=LEASES_BUCKET,
        description="<service> → the lease of its one active copy (leases.Lease: holder, "
        "fencing token); renewed by compare-and-set, taken over when not renewed.",
        max_value_size=4 * 1024,
    ),
    BucketSpec(
        name=SUBSCRIPTIONS_BUCKET,
        description="Telegram bot: telegram.<chat_id> → what that chat subscribed to "
        "(notifications.Subscription); the report service's notifier reads it.",
        max_value_size=64 * 1024,
    ),
    BucketSpec(
        name=NOTIFIED_BUCKET,
        description="Report (notifier): delivery id → sending or sent, so a redelivered "
        "or repeated event never notifies twice.",
        max_value_size=4 * 1024, ttl_s=NOTIFIED_TTL_S,
    ),
)


def subscription_key(channel: str, target: str) -> str:
    """Where one chat's (one target's) subscription is kept."""
    return f"{channel}.{target}"


def secret_key(run_id: str, index: int, nonce: str) -> str:
    """Where set `index` of a run's secret values is stored; the random `nonce` keeps a
    run id that is taken (and retried) from ever naming another run's set."""
    return f"{run_id}.{index}.{nonce}"


def task_key(task_id: str) -> str:
    """A task id (`run/step`) as a KV key (`run.step`), so keys can be listed per run."""
    return task_id.replace("/", ".")


def service_key(name: str, instance: str) -> str:
    return f"{name}.{instance}"
