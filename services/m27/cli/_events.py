"""`m27 events`: the bus's events in a terminal, one line each (or one JSON object each).

The lines are pure (`event_line`, `json_line`); the command only prints what the
orchestrator's `WatchEvents` sends. Every string an event carries (a reason, a name, a
path) may come from a user or a program, so a line is cleaned of control characters.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from typing import Final, assert_never

import msgspec

from m27.cli._common import Subparsers, add, parse_since, with_client
from m27.client import BusEvent, Client
from m27.common import events as ev
from m27.common.errors import M27Error
from m27.common.platform import Platform
from m27.common.units import format_size

TYPE_WIDTH: Final = 20
#: A reason or detail longer than this is cut: a line per event stays a line.
MAX_TEXT: Final = 200
# C0 and C1 controls (newlines, escapes), DEL, bidi embeddings/overrides/isolates.
_UNSAFE: Final = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]+")

EPILOG: Final = """\
examples:
  m27 events                       the latest 200 events you may see
  m27 events --run RUN             every event of one run, from its submission
  m27 events -f                    ... and then new ones as they happen (Ctrl-C stops)
  m27 events --run RUN --json | jq -r 'select(.type == "task_exited") | .exit_code'

A user sees node events and the events of their own runs; an admin sees every event.
"""

TaskScoped = (ev.TaskPlaced | ev.TaskStarted | ev.TaskExited | ev.TaskIdle | ev.TaskBusy
              | ev.TaskStaged | ev.TaskOverShare | ev.TrainingAnomaly
              | ev.CheckpointCommitted | ev.CheckpointCorrupt)
NodeScoped = (ev.NodeRegistered | ev.NodeHeartbeat | ev.NodeStopping | ev.NodeStopped
              | ev.NodeLost | ev.GpuMemoryLeak | ev.NodePlatformDiffers
              | ev.NodeMaintenanceWindow | ev.MaintenanceCommandDone)


def add_commands(sub: Subparsers) -> None:
    events = add(sub, "events", "print the bus's events, oldest first, one line each: a "
                 "run's or the latest of all you may see; -f keeps printing new ones",
                 cmd_events)
    events.formatter_class = argparse.RawDescriptionHelpFormatter
    events.epilog = EPILOG
    events.add_argument("--run", metavar="RUN", default="",
                        help="only this run's events (its run, step and task events)")
    events.add_argument("-f", "--follow", action="store_true",
                        help="keep printing new events as they happen, until Ctrl-C")
    events.add_argument("--json", action="store_true",
                        help="one JSON object per line: the event as published, with its "
                        "subject and stream seq (for jq)")
    events.add_argument("--since", metavar="WHEN",
                        help="start with the events of the last 2h, 3d, ... or since a date "
                        "(2026-12-01)")
    events.add_argument("-n", "--limit", type=int, default=0, metavar="N",
                        help="at most the latest N events before now (default 200; with "
                        "--run, all of the run's)")


def cmd_events(args: argparse.Namespace) -> int:
    if args.limit < 0:
        raise M27Error(f"--limit must be 0 or more, got {args.limit}")
    now = time.time()
    since_s = max(0.001, now - parse_since(args.since, now)) if args.since else 0.0
    render = json_line if args.json else event_line

    async def work(client: Client) -> int:
        async for item in client.events(args.run, follow=args.follow, since_s=since_s,
                                        limit=args.limit):
            print(render(item), flush=True)
        return 0

    try:
        return with_client(args, work)
    except KeyboardInterrupt:  # how a follow is ended
        return 0
    except BrokenPipeError:  # `m27 events | head`
        with contextlib.suppress(OSError):  # the interpreter's last flush must not fail
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# ---------------------------------------------------------------- lines (pure)


def json_line(item: BusEvent) -> str:
    """The event as published, plus `subject` and `seq` (no stored event has those keys)."""
    try:
        body = msgspec.json.decode(item.event_json)
    except msgspec.DecodeError:
        body = item.event_json
    if not isinstance(body, dict):
        body = {"event": body}
    return msgspec.json.encode({**body, "subject": item.subject,
                                "seq": item.sequence}).decode()


def event_line(item: BusEvent) -> str:
    """`time  type  where  what`: e.g. `… step_state_changed  r-…/train  running → failed
    (attempt 2, on node-1, exit 7): no input file`."""
    event = item.event
    if event is None:
        kind, at = _unknown(item.event_json)
        where, what = item.subject, "(a type this m27 does not know: --json shows it)"
    else:
        kind, at, where, what = ev.tag_of(event), event.at, where_of(event), details(event)
    line = f"{_stamp(at)}  {kind:<{TYPE_WIDTH}}  {where}  {what}".rstrip()
    return _UNSAFE.sub(" ", line)


def where_of(event: ev.Event) -> str:
    """The run (`run/step`), task or node an event is about."""
    if isinstance(event, ev.StepStateChanged):
        return f"{event.run_id}/{event.step}"
    if isinstance(event, ev.RunSubmitted | ev.RunStateChanged | ev.ReportReady):
        return event.run_id
    if isinstance(event, TaskScoped):
        return event.task_id
    return event.node_id


def details(event: ev.Event) -> str:
    """An event's salient fields as a phrase."""
    if isinstance(event, TaskScoped):
        return _task_details(event)
    if isinstance(event, NodeScoped):
        return _node_details(event)
    match event:
        case ev.RunSubmitted():
            return (f"{_text(event.name)} by {event.user}: "
                    f"{_count(len(event.steps), 'step')}, urgency {event.urgency}")
        case ev.RunStateChanged():
            return f"{event.previous or 'new'} → {event.state}" + _why(event.reason)
        case ev.StepStateChanged():
            return (f"{event.previous} → {event.state}"
                    + _paren(_attempt(event.attempt), _on(event.node_id),
                             _exit(event.exit_code)) + _why(event.reason))
        case ev.ReportReady():
            return f"report {_text(event.path)}"
        case _:
            assert_never(event)


def _task_details(event: TaskScoped) -> str:
    match event:
        case ev.TaskPlaced():
            return (f"placed on {event.node_id}"
                    + _paren(_attempt(event.attempt),
                             f"GPU {_ids(event.gpu_ids)}" if event.gpu_ids else "",
                             f"share {event.gpu_share:g}" if event.gpu_share else "",
                             "simulated" if event.gpu_simulated else "")
                    + _why(event.reason))
        case ev.TaskStarted():
            return f"started on {event.node_id}" + _paren(_attempt(event.attempt),
                                                          f"pid {event.pid}")
        case ev.TaskExited():
            return _exited(event)
        case ev.TaskIdle():
            return (f"{event.idle_share:.0%} of GPU {_ids(event.gpu_ids)} idle on "
                    f"{event.node_id}" + _paren(_attempt(event.attempt),
                                                f"{event.utilization_pct:.0f}% busy",
                                                _text(event.reason)))
        case ev.TaskBusy():
            return f"busy again on {event.node_id}" + _paren(
                _attempt(event.attempt), f"{event.utilization_pct:.0f}% busy")
        case ev.TaskStaged():
            return (f"{_count(event.files, 'input')} ({format_size(event.bytes)}) staged on "
                    f"{event.node_id} in {event.seconds:.1f}s"
                    + _paren(_many("missing", event.missing),
                             f"{event.skipped} skipped" if event.skipped else ""))
        case ev.TaskOverShare():
            return (f"GPU {event.gpu_index} on {event.node_id} holds {event.used_mb} MiB, "
                    f"over its {event.limit_mb} MiB: {event.action}"
                    + _paren(_attempt(event.attempt)))
        case ev.TrainingAnomaly():
            return _anomaly(event)
        case ev.CheckpointCommitted():
            return (f"checkpoint {event.checkpoint_id} committed"
                    + _paren(_attempt(event.attempt),
                             f"after step {event.step}" if event.step is not None else "",
                             format_size(event.size_bytes),
                             f"{format_size(event.new_bytes)} new"))
        case ev.CheckpointCorrupt():
            return (f"checkpoint {event.checkpoint_id}: chunk {event.chunk_id} "
                    f"{_text(event.reason) or 'damaged'}; fell back to "
                    f"{event.fell_back_to or 'nothing'}")
        case _:
            assert_never(event)


def _exited(event: ev.TaskExited) -> str:
    how = f"exit {event.exit_code}" if event.exit_code is not None else "exit unknown"
    return (f"{how} on {event.node_id}"
            + _paren(_attempt(event.attempt), f"signal {event.signal}" if event.signal else "",
                     f"cause {event.cause}" if event.cause != "exit" else "",
                     "never started" if not event.started else "",
                     _many("missing outputs", event.missing_outputs))
            + _why(event.reason))


def _anomaly(event: ev.TrainingAnomaly) -> str:
    value = _text(event.value, 40) if isinstance(event.value, str) else f"{event.value:g}"
    return (f"{event.kind} in {_text(event.metric, 60)} = {value} at step "
            f"{event.train_step} on {event.node_id}"
            + _paren(_attempt(event.attempt),
                     f"baseline {event.baseline:g}" if event.baseline is not None else "",
                     f"→ {', '.join(event.actions)}" if event.actions else "")
            + _why(event.detail))


def _node_details(event: NodeScoped) -> str:
    match event:
        case ev.NodeRegistered():
            return (f"registered: {_text(event.hostname)}, {_count(len(event.gpus), 'GPU')} "
                    f"({event.backend}), {_count(event.cpu_slots, 'CPU slot')}"
                    + _platform(event.platform))
        case ev.NodeHeartbeat():
            return f"heartbeat: {_count(len(event.running), 'task')} running"
        case ev.NodeStopping():
            return "stopping" + _why(event.reason)
        case ev.NodeStopped():
            return "stopped" + _why(event.reason)
        case ev.NodeLost():
            return f"lost: last heartbeat at {_stamp(event.last_heartbeat)}"
        case ev.GpuMemoryLeak():
            return (f"GPU {event.gpu_index}: {event.memory_mb} MiB still held after "
                    f"{event.task_id} by pid {_ids(event.pids)}, "
                    + ("cleaned" if event.cleaned else "left (not ours to kill)"))
        case ev.NodePlatformDiffers():
            if not event.differences:
                return "driver and CUDA agree with most nodes again"
            return "platform differs: " + "; ".join(_text(d) for d in event.differences)
        case ev.NodeMaintenanceWindow():
            return (f"maintenance window of {_stamp(event.occurrence)}: {event.phase}"
                    + (f", exit {event.exit_code}" if event.exit_code is not None else "")
                    + _why(event.detail))
        case ev.MaintenanceCommandDone():
            return ("maintenance command ended: "
                    + (f"exit {event.exit_code}" if event.exit_code is not None else "no exit")
                    + f" after {event.duration_s:.1f}s" + _why(event.error))
        case _:
            assert_never(event)


def _platform(platform: Platform) -> str:
    known = [f"{label} {_text(value)}" for label, value in
             (("driver", platform.driver), ("CUDA", platform.cuda)) if value]
    return f", {', '.join(known)}" if known else ""


def _unknown(text: str) -> tuple[str, float]:
    """The `type` and `at` of an event this client cannot decode, as far as they read."""
    try:
        body = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return "?", 0.0
    if not isinstance(body, dict):
        return "?", 0.0
    kind, at = body.get("type"), body.get("at")
    return (_text(kind, 40) if isinstance(kind, str) else "?",
            float(at) if isinstance(at, int | float) and not isinstance(at, bool) else 0.0)


def _stamp(at: float) -> str:
    """Local time; "—" for a time no clock shows (0, negative, not finite, too far)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at > 0 else "—"
    except (OverflowError, OSError, ValueError):
        return "—"


def _text(value: str, limit: int = MAX_TEXT) -> str:
    value = " ".join(_UNSAFE.sub(" ", value).split())
    return value if len(value) <= limit else value[:limit - 1] + "…"


def _why(reason: str) -> str:
    return f": {_text(reason)}" if reason else ""


def _paren(*parts: str) -> str:
    kept = [p for p in parts if p]
    return f" ({', '.join(kept)})" if kept else ""


def _attempt(attempt: int) -> str:
    return f"attempt {attempt}" if attempt else ""


def _on(node_id: str | None) -> str:
    return f"on {node_id}" if node_id else ""


def _exit(code: int | None) -> str:
    return f"exit {code}" if code is not None else ""


def _ids(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values) or "—"


def _many(label: str, names: tuple[str, ...]) -> str:
    if not names:
        return ""
    shown = ", ".join(_text(n, 60) for n in names[:3])
    return f"{label}: {shown}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
