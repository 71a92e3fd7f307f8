"""Who may call which RPC, and act on what: the API's one access table (pure).

The interceptor (`m27.common.api_auth`) refuses a call whose role is not listed for its
method (PERMISSION_DENIED; methods not listed: nobody). What a call may touch once it is
in — whose runs, which task's checkpoints, how urgent — the servicers ask here:

- a `user` reads, cancels and retries their own runs and submits as themselves;
- an `admin` acts on anyone's runs, cordons and drains nodes, deletes checkpoints;
- a `service` (the report service) reads any run, changes none;
- a `node` (a node-agent) writes and reads checkpoints and serves step logs;
- a `step` token writes the checkpoints of its own task attempt only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, cast

import msgspec

from m27.common.config import Config, parse_map
from m27.common.errors import ConfigError
from m27.common.model import URGENCIES, Urgency
from m27.common.tokens import ApiRole, Identity

HEALTH_PREFIX: Final = "/grpc.health.v1.Health/"
_READERS: Final[frozenset[ApiRole]] = frozenset({"user", "admin", "service"})
_ACTORS: Final[frozenset[ApiRole]] = frozenset({"user", "admin"})
_ADMIN: Final[frozenset[ApiRole]] = frozenset({"admin"})
_CHECKPOINT_WRITERS: Final[frozenset[ApiRole]] = frozenset({"admin", "node", "step"})
_ANYONE: Final[frozenset[ApiRole]] = frozenset({"user", "admin", "service", "node", "step"})


def _service(name: str, methods: Mapping[str, frozenset[ApiRole]]
             ) -> dict[str, frozenset[ApiRole]]:
    return {f"/m27.v1.{name}/{method}": roles for method, roles in methods.items()}


#: Every RPC of every m27 server and the roles that may call it.
METHOD_ROLES: Final[dict[str, frozenset[ApiRole]]] = {
    **_service("PipelineService", {
        "SubmitPipeline": _ACTORS, "PlanPipeline": _READERS, "GetRun": _READERS,
        "ListRuns": _READERS, "WatchRun": _READERS, "CancelRun": _ACTORS,
        "RetryRun": _ACTORS, "WatchEvents": _READERS}),
    **_service("ClusterService", {"ListNodes": _READERS, "StreamLogs": _READERS}),
    **_service("NodeService", {"TailLog": frozenset({"node"})}),
    **_service("SchedulerService", {
        "SetNodeMaintenance": _ADMIN, "ListNodeMaintenance": _READERS,
        "SetMaintenanceWindow": _ADMIN, "ClearMaintenanceWindow": _ADMIN,
        "ListMaintenanceWindows": _READERS,
        "ListQueue": _READERS}),
    **_service("ReportService", {"GetMetrics": _READERS}),
    **_service("CheckpointService", {
        "MissingChunks": _CHECKPOINT_WRITERS, "PutChunks": _CHECKPOINT_WRITERS,
        "Commit": _CHECKPOINT_WRITERS, "GetManifest": _ANYONE, "GetChunks": _ANYONE,
        "List": _ANYONE, "Delete": _ADMIN, "Protect": _CHECKPOINT_WRITERS}),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": _ANYONE,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": _ANYONE,
}


def needs_token(method: str) -> bool:
    """Health checks are open (probes, `m27 up`); every other call needs a token."""
    return not method.startswith(HEALTH_PREFIX)


def call_problem(method: str, who: Identity,
                 table: Mapping[str, frozenset[ApiRole]] = METHOD_ROLES) -> str | None:
    """Why `who` may not call `method` at all (by `table`), or None."""
    roles = table.get(method)
    if roles is None:
        return f"{method[:200]} is not an m27 method anyone may call"
    if who.role not in roles:
        allowed = " or ".join(sorted(roles))
        return (f"{method.rsplit('/', 1)[-1]} needs the role {allowed}; "
                f"{who.user} has the role {who.role}")
    return None


def run_problem(who: Identity, owner: str, run_id: str, *, acting: bool) -> str | None:
    """Why `who` may not read (`acting` False) or change a run of `owner`, or None."""
    if who.is_admin or who.user == owner:
        return None
    if not acting and who.reads_everything:
        return None
    verb = "change" if acting else "see"
    return f"run {run_id} belongs to another user: only they or an admin may {verb} it"


def sees_event(who: Identity, *, node_event: bool, run_owner: str | None) -> bool:
    """Whether `who` may see a bus event (`WatchEvents`): a node's events anyone who reads
    runs may; a run's (its run, step and task events) only its owner and those who read
    everything. `run_owner` None: the run is unknown (only those who read everything)."""
    if who.reads_everything or node_event:
        return True
    return run_owner is not None and run_owner == who.user


def submitter(who: Identity, claimed: str) -> tuple[str, str | None]:
    """The user a submission runs as — the caller's, never the request's, except that an
    admin may submit on behalf of a user (as Slurm's root may) — and a problem when a
    non-admin claims someone else."""
    if not claimed or claimed == who.user:
        return who.user, None
    if who.is_admin:
        return claimed, None
    return who.user, (f"you are {who.user}: a run cannot be submitted as {claimed[:100]!r} "
                      "(the user comes from your token)")


class Levels(msgspec.Struct, frozen=True, kw_only=True):
    """Each user's level ([scheduler] user_levels, default_level) and the highest urgency
    each level may ask for ([api] max_urgency)."""

    user_levels: dict[str, str]
    default_level: str
    max_urgency: dict[str, Urgency]

    def level(self, user: str) -> str:
        return self.user_levels.get(user, self.default_level)


def levels(config: Config) -> Levels:
    """The levels and caps the config gives; ConfigError names a malformed map or an
    unknown urgency."""
    try:
        caps = parse_map(config.api.max_urgency)
        users = parse_map(config.scheduler.user_levels)
    except ValueError as exc:
        raise ConfigError(f"[api] max_urgency / [scheduler] user_levels: {exc}") from exc
    unknown = sorted(v for v in caps.values() if v not in URGENCIES)
    if unknown:
        raise ConfigError(f"[api] max_urgency: unknown urgency {unknown[0]!r} "
                          f"(known: {', '.join(URGENCIES)})")
    return Levels(user_levels=users, default_level=config.scheduler.default_level,
                  max_urgency={k: cast(Urgency, v) for k, v in caps.items()})


def urgency_problem(who: Identity, urgencies: Iterable[Urgency], rules: Levels) -> str | None:
    """Why a submission by `who` may not ask for one of `urgencies`, or None. Admins are
    not capped; a level with no cap listed gets `high`."""
    if who.is_admin:
        return None
    level = rules.level(who.user)
    limit = URGENCIES.index(rules.max_urgency.get(level, "high"))
    over = sorted({u for u in urgencies if URGENCIES.index(u) > limit}, key=URGENCIES.index)
    if over:
        return (f"urgency {over[-1]} is above what {level} users may ask for "
                f"(at most {URGENCIES[limit]}; [api] max_urgency)")
    return None


def checkpoint_problem(who: Identity, task_id: str, attempt: int | None) -> str | None:
    """Why `who` may not write checkpoints of `task_id` (in `attempt`, if known), or None:
    a step token writes only its own task attempt's."""
    if who.role != "step":
        return None
    if task_id != who.task_id or (attempt is not None and attempt != who.attempt):
        return (f"this step's token is for task {who.task_id} attempt {who.attempt}, not "
                f"{task_id[:200]} attempt {attempt}")
    return None
