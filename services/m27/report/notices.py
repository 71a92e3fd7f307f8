"""From what happened to what is worth telling: events (and waiting tasks, hot GPUs) become
`notifications.Notice`s. Pure.

Each notice's `id` names the happening, not the message that carried it: a redelivered
event, a second copy of it (a publisher's retry, another notifier) or the same waiting
task seen again all give the same id, and the notifier delivers each id once per place.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Final

from m27.common import events
from m27.common.model import RunRecord
from m27.common.notifications import Notice, NoticeKind

#: A GPU is told about at most once per this many seconds (per GPU) while it stays hot.
HOT_EVERY_S: Final = 3600.0
MAX_TEXT: Final = 3000  # Telegram allows 4096; a notice is a summary, the report the rest

_RUN_KINDS: Final[dict[str, NoticeKind]] = {
    "succeeded": "run_succeeded", "failed": "run_failed", "cancelled": "run_cancelled"}
_MARK: Final = {"succeeded": "✅", "failed": "❌", "cancelled": "⏹"}


def run_end_kind(event: events.RunStateChanged) -> NoticeKind | None:
    """The notice kind of a run's end (None: not an end)."""
    return _RUN_KINDS.get(event.state)


def run_ended(event: events.RunStateChanged, run: RunRecord, *,
              metrics: dict[str, float] | None = None, link: str = "") -> Notice | None:
    """A run reached succeeded, failed or cancelled (`run` as the API shows it now)."""
    kind = run_end_kind(event)
    if kind is None:
        return None
    began = run.started_at or run.created_at
    ended = run.ended_at or event.at
    duration = max(0.0, ended - began)
    lines = [f"{_MARK[event.state]} run {run.run_id} ({_clip(run.name, 80)}) {event.state} "
             f"after {human_duration(duration)}"]
    failed = [step for step in run.steps if step.state == "failed"]
    if failed:
        lines.append("failed: " + ", ".join(_clip(step.name, 60) for step in failed[:5]))
    reason = event.reason or run.reason
    if reason and event.state != "succeeded":
        lines.append(_clip(reason, 400))
    if metrics:
        lines.append(" · ".join(f"{_clip(name, 40)} {_number(value)}"
                                for name, value in metrics.items()))
    if link:
        lines.append(link)
    return Notice(id=_id("run", run.run_id, event.state, repr(event.at)), kind=kind,
                  text=_clip("\n".join(lines), MAX_TEXT), at=event.at, run_id=run.run_id,
                  user=run.user, state=event.state, duration_s=duration,
                  metrics=dict(metrics or {}), link=link)


def anomaly(event: events.TrainingAnomaly, user: str) -> Notice:
    baseline = "" if event.baseline is None else f" (baseline {_number(event.baseline)})"
    actions = f"; {', '.join(event.actions)}" if event.actions else ""
    text = (f"⚠ {event.kind} in {_clip(event.metric, 60)} of {event.run_id}/{event.step} at "
            f"step {event.train_step}: {_value(event.value)}{baseline}{actions}")
    return Notice(id=_id("anomaly", event.task_id, str(event.attempt), event.metric,
                         event.kind, str(event.train_step)),
                  kind="training_anomaly", text=_clip(text, MAX_TEXT), at=event.at,
                  run_id=event.run_id, user=user, state=event.kind, step=event.step,
                  node_id=event.node_id)


def node_lost(event: events.NodeLost) -> Notice:
    silent = max(0.0, event.at - event.last_heartbeat)
    text = (f"🔌 node {event.node_id} lost: no heartbeat for {human_duration(silent)}; "
            "its tasks restart elsewhere from their checkpoints")
    return Notice(id=_id("node_lost", event.node_id, repr(event.last_heartbeat)),
                  kind="node_lost", text=text, at=event.at, node_id=event.node_id,
                  state="lost")


def node_platform(event: events.NodePlatformDiffers) -> Notice:
    """A node's driver or CUDA differs from most nodes' (or agrees again)."""
    if event.differences:
        text = (f"⚠ node {event.node_id}: " + "; ".join(event.differences)
                + " — a lab's nodes should run one driver and one CUDA version")
    else:
        text = f"✅ node {event.node_id}: driver and CUDA agree with most nodes again"
    return Notice(id=_id("node_platform", event.node_id, *event.differences, repr(event.at)),
                  kind="node_platform", text=_clip(text, MAX_TEXT), at=event.at,
                  node_id=event.node_id, state="differs" if event.differences else "agrees")


def maintenance_window(event: events.NodeMaintenanceWindow) -> Notice | None:
    """How a node's maintenance window ended (its earlier phases are no notice)."""
    if event.phase not in ("succeeded", "failed"):
        return None
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(event.occurrence))
    if event.phase == "succeeded":
        text = (f"🔧 node {event.node_id}: maintenance window of {when} done, the node "
                "takes work again")
    else:
        output = f"; output: {_clip(event.output_tail.strip(), 300)}" \
            if event.output_tail.strip() else ""
        text = (f"⚠ node {event.node_id}: maintenance window of {when} FAILED: "
                f"{event.detail}{output} — it stays cordoned (`m27 node uncordon "
                f"{event.node_id}`)")
    return Notice(id=_id("node_maintenance", event.node_id, repr(event.occurrence),
                         event.phase),
                  kind="node_maintenance", text=_clip(text, MAX_TEXT), at=event.at,
                  node_id=event.node_id, state=event.phase)


def memory_leak(event: events.GpuMemoryLeak, run_id: str, user: str) -> Notice:
    done = "killed" if event.cleaned else "still running"
    text = (f"🧹 GPU {event.gpu_index} on {event.node_id} still held {event.memory_mb} MB "
            f"after {event.task_id} ended (processes {', '.join(map(str, event.pids[:8]))}: "
            f"{done})")
    return Notice(id=_id("leak", event.node_id, str(event.gpu_index), event.task_id,
                         ",".join(map(str, event.pids))),
                  kind="gpu_memory_leak", text=_clip(text, MAX_TEXT), at=event.at,
                  run_id=run_id, user=user, node_id=event.node_id,
                  state="cleaned" if event.cleaned else "held")


def waiting(task_id: str, run_id: str, user: str, queued_at: float, now: float,
            after_s: float, why: str = "") -> Notice | None:
    """A queued task waiting longer than `after_s` (once per time it was queued)."""
    if after_s <= 0 or now - queued_at < after_s:
        return None
    because = f": {_clip(why, 300)}" if why else ""
    text = f"⏳ {task_id} has waited {human_duration(now - queued_at)} for a GPU{because}"
    return Notice(id=_id("waiting", task_id, repr(queued_at)), kind="task_waiting",
                  text=text, at=now, run_id=run_id, user=user, state="queued",
                  step=task_id.partition("/")[2])


def hot_gpus(reading: events.GpuTelemetry, threshold_c: float) -> list[Notice]:
    """Every GPU of the reading at or above `threshold_c` (once per GPU and HOT_EVERY_S)."""
    found = []
    for gpu in reading.gpus:
        if not math.isfinite(gpu.temperature_c) or gpu.temperature_c < threshold_c:
            continue
        window = int(reading.at // HOT_EVERY_S)
        throttled = f", clocks held down ({', '.join(gpu.throttle)})" if gpu.throttle else ""
        sim = " [simulated GPU]" if gpu.simulated else ""
        text = (f"🔥 GPU {gpu.index} on {reading.node_id} at {gpu.temperature_c:.0f} °C "
                f"(limit {threshold_c:.0f} °C){throttled}{sim}")
        found.append(Notice(id=_id("gpu_hot", reading.node_id, str(gpu.index), str(window)),
                            kind="gpu_hot", text=text, at=reading.at,
                            node_id=reading.node_id, state="hot"))
    return found


def human_duration(seconds: float) -> str:
    """`42 s`, `3 min`, `2 h 05 min`, `3 d 4 h`."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def subject_line(notice: Notice) -> str:
    """A one-line summary (an e-mail's subject)."""
    first = notice.text.splitlines()[0] if notice.text else notice.kind
    return _clip(f"[m27] {first}", 200)


def _id(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


def _value(value: float | str) -> str:
    return value if isinstance(value, str) else _number(value)


def _number(value: float) -> str:
    return str(value) if not math.isfinite(value) else f"{value:.4g}"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
