"""The one configuration loader of every service and the CLI.

Sources, later ones winning: built-in defaults → `~/.m2config` (INI; `$M27_CONFIG` names
another file) → `M27_<SECTION>_<KEY>` environment variables → command-line flags.
Unknown keys are warned about; a bad value is rejected with its section, key and source.
"""

from __future__ import annotations

import configparser
import os
import re
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args, get_origin, get_type_hints

import msgspec

from m27.common.errors import ConfigError
from m27.common.paths import m27_home
from m27.common.units import parse_duration, parse_size

_KIND: Final = "m27_kind"
Duration = Annotated[float, msgspec.Meta(ge=0, extra={_KIND: "duration"})]
Size = Annotated[int, msgspec.Meta(ge=0, extra={_KIND: "size"})]


class NatsSection(msgspec.Struct, frozen=True, kw_only=True):
    url: str = "nats://127.0.0.1:4222"
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1  # 3 on a clustered NATS
    connect_timeout: Duration = 10.0
    # This process's nkey seed file (docs/security.md); empty: connect anonymously, which a
    # bus with users refuses. `m27 up` generates and passes these itself.
    credentials: str = ""
    # TLS: the CA that signed the server's certificate (set: connect with TLS, verify it);
    # a client certificate and key for servers that ask for one (mutual TLS).
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # The embedded server's own certificate and key (`m27 up`); with them it accepts
    # TLS connections only, and with tls_ca set as well it verifies client certificates.
    server_cert: str = ""
    server_key: str = ""


class NodeSection(msgspec.Struct, frozen=True, kw_only=True):
    id: str = ""  # empty: this machine's host name
    gpus: str = "auto"  # auto | none | sim:N | sim:NxMEM (e.g. sim:2x16GiB)
    cpu_slots: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: the number of CPU cores
    heartbeat_interval: Duration = 5.0
    # No lease renewal stored for this long: the node kills its own tasks (self-fencing).
    # Must be shorter than [scheduler] node_timeout, after which they restart elsewhere.
    lease_fence_after: Duration = 10.0
    stop_grace: Duration = 10.0
    # A running task under this GPU utilization for idle_samples samples in a row is idle
    # (I/O wait): its share can be lent out. Utilization and reported phases are read every
    # sample_interval (a longer one: every heartbeat), so idle is seen after about
    # idle_samples x sample_interval; memory limits, energy and leaks are judged at each
    # heartbeat.
    idle_threshold_pct: Annotated[float, msgspec.Meta(ge=0, le=100)] = 10.0
    idle_samples: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    sample_interval: Duration = 1.0
    # A task over its GPU memory share: warn, and with "stop" stop it after
    # over_share_samples samples over.
    over_share: Literal["stop", "warn"] = "stop"
    over_share_samples: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    # Prometheus /metrics (DCGM-exporter names); port 0: a free one; empty: off.
    metrics_bind: str = "127.0.0.1:0"
    # Variables of the agent's own environment a step gets besides the minimal set
    # (docs/isolation.md, "A step's environment"): names, or prefixes ending in `*`.
    pass_env: str = ""


class SchedulerSection(msgspec.Struct, frozen=True, kw_only=True):
    node_timeout: Duration = 15.0  # no heartbeat for this long: the node is lost
    gpu_light_share: Annotated[float, msgspec.Meta(ge=0.1, le=0.9)] = 0.5
    tick: Duration = 1.0
    # The policy's knobs (docs/configuration.md; the score formula in docs/scheduling.md).
    # Maps are written `name:value,name:value`.
    urgency_weights: str = "low:0,normal:100,high:200,urgent:400"
    user_levels: str = ""  # e.g. "alice:pi,bob:staff"; anyone else has default_level
    level_weights: str = "student:0,staff:20,pi:40"
    default_level: str = "student"
    aging_per_hour: Annotated[float, msgspec.Meta(ge=0.0)] = 25.0
    held_per_gpu_hour: Annotated[float, msgspec.Meta(ge=0.0)] = 5.0
    max_temperature: Annotated[float, msgspec.Meta(ge=0.0, le=150.0)] = 80.0  # °C
    min_runtime: Duration = 300.0  # computing less than this in its attempt: not preempted
    preempt_grace: Duration = 60.0  # checkpoint-then-stop: SIGKILL after this
    preemption: bool = True
    # A task whose last this-many attempts were each preempted before committing a
    # checkpoint is not preempted again until its current attempt commits one. 0: off.
    max_fruitless_preemptions: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 3
    backfill: bool = True
    ready_pool: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 2
    # On how many of the nodes that could hold it a ready-pool task is read ahead.
    stage_nodes: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 4
    # Waiting background tasks per GPU share asked read ahead where idle shares are lent.
    backfill_pool: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 4
    max_pause: Duration = 600.0  # paused longer: a victim for the memory it holds
    # Least-attained-service among peers: a task that has held less than this many
    # GPU-hours may preempt a preemptible peer that has held more. 0: off.
    peer_yield_gpu_hours: Annotated[float, msgspec.Meta(ge=0.0)] = 4.0
    # Prometheus /metrics (preemptions, decisions); port 0: a free one; empty: off.
    metrics_bind: str = "127.0.0.1:0"
    # One copy acts, holding a lease it renews (docs/reliability.md, "Safe singletons"): a
    # standby takes over within lease + 2 s after the active copy stops renewing.
    lease: Annotated[float, msgspec.Meta(ge=1.0, le=600.0, extra={_KIND: "duration"})] = 10.0
    # Maintenance windows, one per line (m27.common.windows.parse_config), e.g.
    # "gpu-01,gpu-02 03:00 day Europe/Berlin -> nvidia-smi --gpu-reset"; set at start.
    windows: str = ""


class PerformanceSection(msgspec.Struct, frozen=True, kw_only=True):
    gpu_streams: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    memory_overprovision: Annotated[float, msgspec.Meta(ge=1.0, le=4.0)] = 1.0
    io_timeout: Duration = 0.05


class CheckpointSection(msgspec.Struct, frozen=True, kw_only=True):
    compression_level: Annotated[int, msgspec.Meta(ge=1, le=22)] = 3
    diff_threshold: Size = 128 * 1024
    dir: str = ""  # empty: $M27_HOME/checkpoints
    max_size: Size = 64 * 1024**3  # the largest checkpoint the store accepts
    # Retention, after each commit: a task keeps its last keep_last checkpoints (0: all)
    # and every keep_every-th one in commit order (0: none for that reason).
    keep_last: Annotated[int, msgspec.Meta(ge=0)] = 3
    keep_every: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Garbage collection of chunks no checkpoint references: at start and this often (0: off).
    gc_interval: Duration = 600.0
    # An unreferenced chunk younger than this stays: it may belong to an upload in progress.
    gc_grace: Duration = 3600.0
    # A finished run's checkpoints are removed this long after it ended (0: kept for ever;
    # without a limit the store grows with every run ever checkpointed).
    keep_finished: Duration = 30 * 86400.0


class ReportSection(msgspec.Struct, frozen=True, kw_only=True):
    dir: str = ""  # empty: $M27_HOME/reports
    #: the live dashboard's HTTP bind (host:port, port 0: any free one); empty: off
    dashboard: str = "127.0.0.1:0"


class ApiSection(msgspec.Struct, frozen=True, kw_only=True):
    """The gRPC API's keys, TLS and caps (docs/security.md, "The API")."""

    # The control-plane key that signs and checks API tokens (orchestrator, scheduler,
    # checkpoint-store, report, `m27 api token`); empty: $M27_HOME/credentials/api/control.key.
    key_file: str = ""
    # A node-agent's key (it signs only node and step tokens); empty:
    # $M27_HOME/credentials/api/node.key.
    node_key_file: str = ""
    # This server's certificate and key: set, gRPC is served over TLS only (any address);
    # unset, only on loopback. tls_client_ca set as well: clients need a certificate it
    # signed (mutual TLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Calling an API (the CLI, a service calling another, a step): the CA that signed the
    # servers' certificates (set: connect with TLS), and this side's certificate and key
    # for servers that ask for one.
    tls_ca: str = ""
    client_cert: str = ""
    client_key: str = ""
    # The highest urgency a user of each level ([scheduler] user_levels) may ask for;
    # a level not listed: high. Admins are not capped.
    max_urgency: str = "student:high,staff:high,pi:urgent"


class ClientSection(msgspec.Struct, frozen=True, kw_only=True):
    api: str = ""  # host:port of the orchestrator; empty: the embedded system's
    # This client's API token (a file made by `m27 api token create`); empty:
    # $M27_HOME/credentials/api/cli.token, which `m27 up` writes. $M27_TOKEN wins over both.
    token_file: str = ""


class NotifySection(msgspec.Struct, frozen=True, kw_only=True):
    """Notifications (docs/notifications.md): which events go to which channel."""

    # One rule per line (or `;`-separated): `KINDS [user=A,B] [run=GLOB] -> CHANNEL[:TO]`,
    # e.g. `run_failed training_anomaly user=alice -> email:alice@lab.example`. Empty: the
    # default rule, run ends, anomalies, lost nodes and leaks to every configured channel
    # (the webhook, email_to).
    rules: str = ""
    # One JSON POST per notification (`type`, `run_id`, `state`, `user`, `text`, ...).
    webhook: str = ""
    webhook_timeout: Duration = 10.0
    # E-mail over SMTP: the server, who sends, the default recipients (comma-separated).
    smtp_host: str = ""
    smtp_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0: 587 with starttls, else 25
    smtp_user: str = ""
    smtp_password_file: str = ""  # a file holding the password (never the password itself)
    smtp_starttls: bool = False
    smtp_tls: bool = False  # implicit TLS (port 465)
    email_from: str = ""
    email_to: str = ""
    # A queued task waiting longer than this: `task_waiting` (0: never).
    waiting_after: Duration = 3600.0
    # A GPU at or above this temperature (°C): `gpu_hot`, at most once an hour per GPU.
    gpu_hot_c: Annotated[float, msgspec.Meta(ge=0.0, le=150.0)] = 85.0


class TelegramSection(msgspec.Struct, frozen=True, kw_only=True):
    """The Telegram bot (docs/telegram.md)."""

    token: str = ""  # BotFather's token; prefer token_file or $M27_TELEGRAM_TOKEN
    token_file: str = ""
    # The Bot API server's root: the bot calls {api_url}/bot{token}/{method}.
    api_url: str = "https://api.telegram.org"
    # `<telegram user id>:<m27 user>,...`: who may use the bot, as whom. Nobody else.
    allowed_users: str = ""
    # Empty: long polling. Else the public HTTPS URL Telegram posts updates to, served on
    # webhook_bind, each checked against the secret in webhook_secret_file.
    webhook_url: str = ""
    webhook_bind: str = "127.0.0.1:8443"
    webhook_secret_file: str = ""


class SupervisorSection(msgspec.Struct, frozen=True, kw_only=True):
    """How `m27 up`'s supervisor restarts a process that exits (docs/reliability.md,
    "A process dies"; the policy is `m27.embedded.restarts`)."""

    restart_backoff: Duration = 1.0  # the first restart after an exit waits this long,
    restart_backoff_max: Duration = 30.0  # each next one in a row twice that, at most this
    stable_after: Duration = 60.0  # up this long: the next exit starts over at restart_backoff
    # This many exits within give_up_window: no more restarts, `m27 status` says it is
    # crash-looping (0: restart for ever).
    give_up_after: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 5
    give_up_window: Duration = 600.0


class Config(msgspec.Struct, frozen=True, kw_only=True):
    nats: NatsSection = NatsSection()
    node: NodeSection = NodeSection()
    scheduler: SchedulerSection = SchedulerSection()
    performance: PerformanceSection = PerformanceSection()
    checkpoint: CheckpointSection = CheckpointSection()
    report: ReportSection = ReportSection()
    api: ApiSection = ApiSection()
    client: ClientSection = ClientSection()
    notify: NotifySection = NotifySection()
    telegram: TelegramSection = TelegramSection()
    supervisor: SupervisorSection = SupervisorSection()


class LoadedConfig(msgspec.Struct, frozen=True, kw_only=True):
    config: Config
    warnings: tuple[str, ...]
    path: str | None  # the file that was read, if any
    home: Path  # $M27_HOME as this config's environment gives it (common.paths.m27_home)


Overrides = Mapping[tuple[str, str], object]


def default_config_path(environ: Mapping[str, str]) -> Path:
    explicit = environ.get("M27_CONFIG")
    return Path(explicit).expanduser() if explicit else Path.home() / ".m2config"


def load_config(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Overrides | None = None,
) -> LoadedConfig:
    """Read every source and return the validated config; ConfigError names what is wrong."""
    env = os.environ if environ is None else environ
    file_path = path if path is not None else default_config_path(env)
    raw: dict[str, dict[str, tuple[object, str]]] = {}
    warnings: list[str] = []
    read_path: str | None = None
    if file_path.is_file():
        read_path = str(file_path)
        _merge_file(file_path, raw, warnings)
    _merge_env(env, raw)
    for (section, key), value in (overrides or {}).items():
        if value is not None:
            raw.setdefault(section, {})[key] = (value, "command line")
    return LoadedConfig(config=_build(raw), warnings=tuple(warnings), path=read_path,
                        home=m27_home(env))


def _fields() -> dict[str, dict[str, Any]]:
    """section → key → the field's annotated type."""
    sections: dict[str, dict[str, Any]] = {}
    for section, section_type in get_type_hints(Config).items():
        sections[section] = get_type_hints(section_type, include_extras=True)
    return sections


def _merge_file(
    path: Path, raw: dict[str, dict[str, tuple[object, str]]], warnings: list[str]
) -> None:
    parser = configparser.ConfigParser(inline_comment_prefixes=("#", ";"), interpolation=None)
    try:
        text = path.read_text(encoding="utf-8")
        parser.read_string(text, source=str(path))
    except (configparser.Error, UnicodeDecodeError, OSError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: not a valid INI file: {first_line}") from exc
    known = _fields()
    for section in parser.sections():
        if section not in known:
            warnings.append(f"{path}: unknown section [{section}] ignored "
                            f"(known: {', '.join(sorted(known))})")
            continue
        for key, value in parser.items(section):
            if key not in known[section]:
                warnings.append(f"{path}: unknown key [{section}] {key} ignored "
                                f"(known: {', '.join(sorted(known[section]))})")
                continue
            raw.setdefault(section, {})[key] = (value, str(path))


def _merge_env(env: Mapping[str, str], raw: dict[str, dict[str, tuple[object, str]]]) -> None:
    for section, keys in _fields().items():
        for key in keys:
            name = f"M27_{section.upper()}_{key.upper()}"
            if name in env:
                raw.setdefault(section, {})[key] = (env[name], f"${name}")


def _build(raw: dict[str, dict[str, tuple[object, str]]]) -> Config:
    known = _fields()
    data: dict[str, dict[str, object]] = {}
    for section, values in raw.items():
        if section not in known:
            raise ConfigError(f"unknown config section [{section}]")
        for key, (value, source) in values.items():
            if key not in known[section]:
                raise ConfigError(f"{source}: unknown config key [{section}] {key}")
            parse = _parser_for(known[section][key])
            try:
                parsed = parse(value)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{source}: [{section}] {key} = {value!r}: {exc}") from exc
            data.setdefault(section, {})[key] = parsed
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe_validation(exc, raw)) from exc


def _parser_for(annotation: Any) -> Callable[[object], object]:
    base, kind = annotation, None
    if get_origin(annotation) is Annotated:
        base, *metas = get_args(annotation)
        for meta in metas:
            if isinstance(meta, msgspec.Meta) and meta.extra:
                kind = meta.extra.get(_KIND)
    if kind == "duration":
        return lambda v: parse_duration(v if isinstance(v, int | float) else str(v))
    if kind == "size":
        return lambda v: parse_size(v if isinstance(v, int) else str(v))
    if base is bool:
        return _parse_bool
    if base is int:
        return lambda v: int(str(v).strip())
    if base is float:
        return lambda v: float(str(v).strip())
    return lambda v: str(v).strip()


def _parse_bool(value: object) -> bool:
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected true or false")


def _describe_validation(
    exc: msgspec.ValidationError, raw: dict[str, dict[str, tuple[object, str]]]
) -> str:
    message = str(exc)
    what, _, where = message.partition(" - at `$.")
    parts = where.rstrip("`").split(".")
    if len(parts) == 2:
        section, key = parts
        value, source = raw.get(section, {}).get(key, (None, "config"))
        return f"{source}: [{section}] {key} = {value!r}: {what.lower()}"
    return f"invalid configuration: {message}"


def parse_map(text: str) -> dict[str, str]:
    """`a:1,b:2` → {"a": "1", "b": "2"}; blanks ignored; ValueError for an item without `:`."""
    pairs: dict[str, str] = {}
    for item in text.split(","):
        name, sep, value = item.partition(":")
        if item.strip() and not sep:
            raise ValueError(f"expected name:value, got {item.strip()!r}")
        if name.strip():
            pairs[name.strip()] = value.strip()
    return pairs


def node_id_default() -> str:
    """The host name as a node id: dots (not allowed in subjects) become dashes."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0]).strip("-_")
    return host[:100] or "node"


#: Keys whose values are secrets: shown as "(set)" wherever the config is printed or logged.
#: (A webhook URL often carries its own secret, as Slack's and Teams' do.)
SECRET_KEYS: Final = frozenset({("telegram", "token"), ("notify", "webhook")})


def effective(config: Config) -> dict[str, Any]:
    """The config as plain data, for the log line every service writes at start (secrets
    are only said to be set, never shown)."""
    result: dict[str, Any] = msgspec.to_builtins(config)
    for section, key in SECRET_KEYS:
        if result.get(section, {}).get(key):
            result[section][key] = "(set)"
    return result
