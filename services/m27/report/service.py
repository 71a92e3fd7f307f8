"""The report service's shell: when a run ends, fetch it, write its HTML report, announce it;
materialise metrics and telemetry into the history; serve it (`api.ReportServicer`).

    read RunStateChanged → decide → GetRun (orchestrator) → render → write atomically
    → publish ReportReady → store the position
    read MetricPoints → check its sender (and the task's fence) → the history store
        (`store.History`), with the position
    read GpuTelemetry → check its sender → the history store, with the position
    read checkpoint_committed / training_anomaly → check its sender → the history, with
        the position

Each copy reads every stream itself from its own stored position (`replica`): any number
of copies each hold the whole history and write every report. An API that cannot be
reached (or answers with an error) makes the handler raise, so the event is tried again;
a run the API does not know is logged and passed, never retried forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from m27.client import Client
from m27.common import bus, events, subjects
from m27.common.api_auth import ApiAccess
from m27.common.bus import Bus
from m27.common.config import Config
from m27.common.errors import M27Error, NotFoundError, Unavailable
from m27.common.logging import bound_contextvars, get_logger
from m27.common.model import TERMINAL_RUN_STATES, Fence, RunRecord, ServiceInfo
from m27.common.principals import metrics_problem, sender_problem, telemetry_problem
from m27.common.service import ServiceRuntime
from m27.plots import phone
from m27.report.api import SERVICE_NAME, ReportServicer, register
from m27.report.channels import make_channels
from m27.report.compare import compare, members_of
from m27.report.compare_page import draw, page
from m27.report.dashboard import Dashboard
from m27.report.decide import (
    ORCHESTRATOR,
    decide,
    pick_orchestrator,
    pick_service,
    report_file,
)
from m27.report.evidence import gather
from m27.report.files import write_atomic
from m27.report.notify import Notifier, describe_rules
from m27.report.render import render_run_report
from m27.report.replica import Progress, Source, follow
from m27.report.store import Applied, History

#: What each copy materialises itself (`replica`), each from its own stored position.
METRICS: Final = Source("metrics", subjects.METRICS_STREAM, (subjects.METRICS_ALL,))
TELEMETRY: Final = Source("telemetry", subjects.TELEMETRY_STREAM, (subjects.TELEMETRY_ALL,))
TASK_EVENTS: Final = Source("task-events", subjects.EVENTS_STREAM, (subjects.TASK_EVENTS_ALL,))
RUN_STATES: Final = Source("run-states", subjects.EVENTS_STREAM, (subjects.RUN_STATE_ALL,))
#: How long the history store keeps metrics and GPU samples (the streams keep 30 days).
HISTORY_KEEP_S = 30 * 86400.0

log = get_logger()


FetchRun = Callable[[str, str], Awaitable[RunRecord]]


class ReportError(M27Error):
    """The report service cannot do its work (no API to ask, no directory to write to)."""


class NoOrchestrator(ReportError, Unavailable):
    """No orchestrator is registered yet; the event is retried until one is."""


class RunNotFinished(ReportError, Unavailable):
    """The API does not show the run as finished yet; the event is retried."""


def report_dir(config: Config, home: Path) -> Path:
    """`[report] dir`, else `$M27_HOME/reports`, as an absolute path (it goes into events)."""
    configured = config.report.dir
    path = Path(configured).expanduser() if configured else home / "reports"
    return path.absolute()


def fetcher(access: ApiAccess) -> FetchRun:
    """GetRun on the orchestrator at an address, as `access` (the report service's own
    `service` token); ClientError / NotFoundError on failure."""
    async def fetch_run(address: str, run_id: str) -> RunRecord:
        async with Client(address, access=access) as client:
            return await client.get_run(run_id)

    return fetch_run


_DRAWING = threading.Lock()  # matplotlib's settings are global while a figure is drawn


def write_report(run: RunRecord, path: Path, *, generated_at: float,
                 history: History | None = None) -> int:
    """Render (with what `history` holds of the run) and write atomically (blocking: run it
    in a thread); returns the bytes written."""
    with _DRAWING:
        found = gather(history, run) if history is not None else None
        text = render_run_report(run, generated_at=generated_at, evidence=found)
    write_atomic(path, text)
    return len(text.encode("utf-8"))


class Reporter:
    """Handles the run-state events of the report consumer, one at a time."""

    def __init__(self, nats: Bus, out_dir: Path, *, api: str = "",
                 fetch: FetchRun, clock: Callable[[], float] = time.time,
                 history: History | None = None) -> None:
        self._nats = nats
        self.out_dir = out_dir
        self.history = history
        self._api = api
        self._fetch = fetch
        self._clock = clock

    async def handle(self, msg: Msg, applied: Applied | None = None) -> bool:
        """A run-state event: returns once the report is durable (or not wanted), and
        then (with `applied`) stores the replica's position; True when it did."""
        event = bus.decode_or_poison(msg.data, events.decode_event)
        decision = decide(event)
        if not decision.write:
            log.debug("report.skipped", run_id=decision.run_id, reason=decision.reason)
            return False
        with bound_contextvars(run_id=decision.run_id):
            await self.report(decision.run_id)
        if applied is None or self.history is None:
            return False
        await asyncio.to_thread(self.history.mark, applied)
        return True

    async def report(self, run_id: str) -> Path | None:
        """Fetch, write and announce one run's report; None when the API does not know it."""
        address = await self.api_address()
        try:
            run = await self._fetch(address, run_id)
        except NotFoundError:
            log.warning("report.run_not_found", api=address)
            return None
        if run.state not in TERMINAL_RUN_STATES:
            raise RunNotFinished(f"the API at {address} still shows run {run_id} as "
                                 f"{run.state}; retrying")
        path = report_file(self.out_dir, run_id)
        size = await asyncio.to_thread(write_report, run, path, generated_at=self._clock(),
                                       history=self.history)
        ready = events.ReportReady(at=self._clock(), run_id=run_id, path=str(path))
        await self._nats.publish(subjects.run_report(run_id), ready, msg_id=f"{run_id}:report")
        log.info("report.written", path=str(path), state=run.state, steps=len(run.steps),
                 bytes=size)
        return path

    async def api_address(self) -> str:
        """The `--api` address, else the newest orchestrator registered in the services KV."""
        if self._api:
            return self._api
        address = pick_orchestrator(await registered(self._nats, ORCHESTRATOR))
        if address is None:
            raise NoOrchestrator(f"no orchestrator is registered in "
                                 f"{subjects.SERVICES_BUCKET}; is it running?")
        return address


async def registered(nats: Bus, name: str) -> list[tuple[str, ServiceInfo]]:
    """The registrations of service `name` in the services KV."""
    found = []
    for key in await nats.kv_keys(subjects.SERVICES_BUCKET):
        if not key.startswith(f"{name}."):
            continue
        entry = await nats.kv_get(subjects.SERVICES_BUCKET, key, ServiceInfo)
        if entry is not None:
            found.append((key, entry[0]))
    return found


class MetricsIn:
    """Materialises the metrics stream into the history store, one batch at a time (a
    batch is written before it is acked; a redelivered one changes nothing). Points of an
    attempt that the task's fence gives to another node are refused (dead-lettered)."""

    def __init__(self, history: History, nats: Bus | None = None) -> None:
        self.history = history
        self._nats = nats

    async def handle(self, msg: Msg, applied: Applied | None = None) -> bool:
        batch = bus.decode_or_poison(msg.data, events.decode_metrics)
        problem = metrics_problem(msg.subject, batch) or metrics_problem(
            msg.subject, batch, await _fence(self._nats, batch.task_id))
        if problem:
            raise bus.PoisonMessage(f"refused: {problem}")
        await asyncio.to_thread(self.history.add_metrics, batch, applied)
        return True


class TaskEventsIn:
    """Keeps what a run report draws on its timeline: each task's committed checkpoints
    and its training monitor's anomalies (every other task event is acked and left). An
    event whose sender cannot have sent it is refused (dead-lettered), as by the
    orchestrator."""

    def __init__(self, history: History, nats: Bus | None = None) -> None:
        self.history = history
        self._nats = nats

    async def handle(self, msg: Msg, applied: Applied | None = None) -> bool:
        event = bus.decode_or_poison(msg.data, events.decode_event)
        if not isinstance(event, events.CheckpointCommitted | events.TrainingAnomaly):
            return False
        fence = await _fence(self._nats, event.task_id)
        problem = sender_problem(msg.subject, event, fence)
        if problem:
            raise bus.PoisonMessage(f"refused: {problem}")
        if isinstance(event, events.CheckpointCommitted):
            await asyncio.to_thread(self.history.add_checkpoint, event, applied)
        else:
            await asyncio.to_thread(self.history.add_anomaly, event, applied)
        return True


async def _fence(nats: Bus | None, task_id: str) -> Fence | None:
    """The task's current assignment; None without a bus (a store-only test) or once over."""
    return None if nats is None else await bus.fence_of(nats, task_id)


class TelemetryIn:
    """Materialises the telemetry stream (every node's heartbeat readings) into the
    history store."""

    def __init__(self, history: History) -> None:
        self.history = history

    async def handle(self, msg: Msg, applied: Applied | None = None) -> bool:
        reading = bus.decode_or_poison(msg.data, events.decode_telemetry)
        problem = telemetry_problem(msg.subject, reading)
        if problem:
            raise bus.PoisonMessage(f"refused: {problem}")
        await asyncio.to_thread(self.history.add_telemetry, [reading], applied)
        return True


def history_path(home: Path) -> Path:
    """The history store: `$M27_HOME/history/history.sqlite` (the streams are the source
    of truth: module `store`)."""
    return home / "history" / "history.sqlite"


async def prune_every(history: History, stop: asyncio.Event, keep_s: float = HISTORY_KEEP_S,
                      every_s: float = 3600.0) -> None:
    """Retention: forget what is older than `keep_s`, now and every `every_s`."""
    while not stop.is_set():
        await asyncio.to_thread(history.prune, time.time() - keep_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def serve(rt: ServiceRuntime) -> None:
    """Run the report service until `rt.stop` is set (a consumer that dies sets it too)."""
    out_dir = report_dir(rt.config, rt.home)
    await asyncio.to_thread(_ensure_dir, out_dir)
    await asyncio.to_thread(_ensure_dir, history_path(rt.home).parent)
    history = await asyncio.to_thread(History, history_path(rt.home))
    await rt.connect()
    fetch = fetcher(rt.api_access())
    reporter = Reporter(rt.nats, out_dir, api=rt.args.api or "", fetch=fetch,
                        history=history)

    async def owner_of(run_id: str) -> str:
        return (await fetch(await reporter.api_address(), run_id)).user

    await rt.serve_grpc([register(ReportServicer(history, owner_of))], [SERVICE_NAME])
    dashboard, http_address = await _start_dashboard(rt, history, out_dir)
    progress = Progress()
    js = rt.nats.js
    for source, handle in ((METRICS, MetricsIn(history, rt.nats).handle),
                           (TELEMETRY, TelemetryIn(history).handle),
                           (TASK_EVENTS, TaskEventsIn(history, rt.nats).handle),
                           (RUN_STATES, reporter.handle)):
        rt.spawn(follow(js, history, source, handle, rt.stop, progress), source.name)
    rt.spawn(prune_every(history, rt.stop), "history-retention")
    notifier = await _start_notifier(rt, reporter, fetch, history, progress)
    await rt.ready(http_address=http_address)
    log.info("report.watching", dir=str(out_dir), api=rt.args.api or "discovered",
             dashboard=f"http://{http_address}/" if http_address else "off")
    try:
        await rt.stop.wait()
    finally:
        if dashboard is not None:
            await dashboard.stop()
        await rt.join()  # a notice being sent is sent and marked before its channel closes
        await notifier.close()


async def _start_notifier(rt: ServiceRuntime, reporter: Reporter, fetch: FetchRun,
                          history: History, progress: Progress) -> Notifier:
    """The notifier's consumers (new events only, the first time: a fresh notifier does
    not tell about the last 30 days) and its waiting-task watch."""
    channels = make_channels(rt.config)
    js = rt.nats.js

    async def picture_of(run_id: str) -> tuple[dict[str, float], bytes | None]:
        await metrics_caught_up(js, progress)  # its last points were sent before it ended
        return await asyncio.to_thread(picture, history, run_id)

    notifier = Notifier(rt.nats, dict(channels), section=rt.config.notify,
                        run_of=run_fetcher(reporter, fetch), picture=picture_of)
    rt.spawn(bus.consume(rt.nats.js, stream=subjects.EVENTS_STREAM,
                         durable=subjects.REPORT_NOTIFY, filter_subject=subjects.EVENTS_ALL,
                         handle=notifier.handle, stop=rt.stop, deliver_new=True), "notify")
    rt.spawn(bus.consume(rt.nats.js, stream=subjects.TELEMETRY_STREAM,
                         durable=subjects.REPORT_NOTIFY_TELEMETRY,
                         filter_subject=subjects.TELEMETRY_ALL,
                         handle=notifier.handle_telemetry, stop=rt.stop, deliver_new=True,
                         batch=64), "notify-telemetry")
    rt.spawn(notifier.watch_waiting(rt.stop), "notify-waiting")
    log.info("notify.rules", rules=describe_rules(notifier.rules),
             channels=sorted(channels), subscriptions=subjects.SUBSCRIPTIONS_BUCKET)
    return notifier


def run_fetcher(reporter: Reporter, fetch: FetchRun) -> Callable[[str], Awaitable[
        RunRecord | None]]:
    """GetRun through the report's own API access; None for a run the API does not know."""
    async def run_of(run_id: str) -> RunRecord | None:
        try:
            return await fetch(await reporter.api_address(), run_id)
        except NotFoundError:
            return None

    return run_of


async def metrics_caught_up(js: JetStreamContext, progress: Progress,
                            timeout_s: float = 10.0) -> bool:
    """Wait (at most `timeout_s`) until the history holds every metric point published so
    far: this copy has read the metrics stream past its last message. False when not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            last = (await js.stream_info(METRICS.stream)).state.last_seq
            if progress.next.get(METRICS.name, 0) > last:
                return True
        await asyncio.sleep(0.1)
    return False


def picture(history: History, run_id: str) -> tuple[dict[str, float], bytes | None]:
    """A finished run's key metrics and main curve (PNG) for its notice (blocking)."""
    curves = history.curves(run_id, max_points=300)
    with _DRAWING:
        return phone.key_metrics(curves), phone.curve_png(curves, title=run_id)


async def _start_dashboard(rt: ServiceRuntime, history: History, out_dir: Path
                           ) -> tuple[Dashboard | None, str]:
    """The live dashboard on `[report] dashboard` (off when empty), fed with every bus
    event; (it, its address)."""
    bind = rt.config.report.dashboard
    if not bind:
        return None, ""
    nats = rt.nats

    async def locate(name: str) -> str:
        address = (rt.args.api if name == ORCHESTRATOR and rt.args.api else
                   pick_service(await registered(nats, name), name))
        if not address:
            raise Unavailable(f"no {name} is registered in {subjects.SERVICES_BUCKET}")
        return address

    async def comparison(run: RunRecord) -> str:
        return await asyncio.to_thread(compare_html, history, run)

    dashboard = Dashboard(history, rt.api_keys, rt.api_access(), locate, out_dir, comparison)
    address = await dashboard.start(bind)

    async def on_event(msg: Msg) -> None:
        dashboard.on_event(msg)

    await nats.nc.subscribe(subjects.EVENTS_ALL, cb=on_event)
    return dashboard, address


def compare_html(history: History, run: RunRecord) -> str:
    """The comparison page of one run (its sweep's members), from the history (blocking)."""
    curves = history.curves(run.run_id)
    members = members_of([run], {run.run_id: curves})
    if not members:
        raise NotFoundError(f"run {run.run_id} logged no metrics to compare")
    comparison = compare(members)
    with _DRAWING:
        drawn = draw(comparison, members)
        return page(comparison, drawn, title=run.run_id, generated=time.strftime(
            "%Y-%m-%d %H:%M:%S UTC", time.gmtime()))


def _ensure_dir(path: Path) -> None:
    """Fail at start, with the path, rather than on the first finished run."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"cannot create the report directory {path}: {exc}") from exc
