"""What the bot says, as plain text for a phone (pure).

Everything is sent as plain text (no parse mode), so nothing a user wrote — a run name, a
pipeline's error, a file name — can be taken for markup. A monospaced block (a plan, an
error listing) is marked with a `pre` entity instead of backticks; `compose` places it
and keeps the whole message within Telegram's limit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

import msgspec

from m27.client import NodeStatus, RunSummary
from m27.client.scheduler import QueueItem
from m27.common.model import RunRecord, StepRecord
from m27.common.notifications import Subscription, button_data
from m27.common.units import format_duration

#: Telegram's limits: a message's text, a photo's or document's caption (UTF-16 units).
MESSAGE_LIMIT: Final = 4096
CAPTION_LIMIT: Final = 1024
CUT_MARK: Final = "\n… (cut)"
NOT_FOR_ME: Final = "I only understand commands; send /help to see them."
SYSTEM_DOWN: Final = "m27 cannot be reached right now ({why}); try again in a minute."
MAX_LISTED: Final = 30

_STATE_MARK: Final = {"succeeded": "✅", "failed": "❌", "cancelled": "⏹", "running": "▶",
                      "queued": "⏳", "pending": "⏳", "skipped": "⏭"}


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One message: its text, where its monospaced block is (UTF-16 offset and length, as
    Telegram counts) when it has one, and its buttons (label, callback data)."""

    text: str
    pre: tuple[int, int] | None = None
    buttons: tuple[tuple[str, str], ...] = ()


class Photo(msgspec.Struct, frozen=True, kw_only=True):
    png: bytes
    caption: str


class Upload(msgspec.Struct, frozen=True, kw_only=True):
    data: bytes
    filename: str
    caption: str


Out = Message | Photo | Upload


def utf16_len(value: str) -> int:
    return len(value.encode("utf-16-le")) // 2


def cut(value: str, limit: int = MESSAGE_LIMIT, mark: str = CUT_MARK) -> str:
    """`value` within `limit` UTF-16 units, ending with `mark` when something was cut."""
    if utf16_len(value) <= limit:
        return value
    room = limit - utf16_len(mark)
    kept: list[str] = []
    used = 0
    for char in value:
        size = 2 if ord(char) > 0xFFFF else 1
        if used + size > room:
            break
        kept.append(char)
        used += size
    return "".join(kept) + mark


def compose(head: str, block: str = "", limit: int = MESSAGE_LIMIT) -> Message:
    """`head`, then `block` monospaced on the lines after it; the block is cut first
    when the whole would be longer than `limit`."""
    head = cut(head.strip() or "…", limit // 2 if block else limit)
    if not block.strip():
        return Message(text=head)
    start = utf16_len(head) + 1
    block = cut(block.strip("\n"), limit - start)
    return Message(text=f"{head}\n{block}", pre=(start, utf16_len(block)))


def refusal(telegram_id: int) -> str:
    return (f"Sorry, you are not allowed to use this bot; ask the lab's admin to add your "
            f"Telegram id {telegram_id} to [telegram] allowed_users.")


def help_text(user: str, start: bool = False, menu: Sequence[tuple[str, str]] = ()) -> str:
    hello = f"Hello! You use m27 here as {user}.\n\n" if start else f"You are {user} here.\n\n"
    commands = "\n".join(f"/{name} — {what}" for name, what in menu)
    return (f"{hello}{commands}\n\nTo submit, attach a pipeline YAML with the caption "
            "/submit NAME=VALUE …, or paste it on the lines after /submit.")


def when(at: float | None, now: float) -> str:
    """`3m ago`, `2h ago`, or a date for older times."""
    if not at:
        return "—"
    age = now - at
    if age < 86400:
        return f"{format_duration(max(age, 0.0))} ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at))


def run_line(run: RunSummary, now: float) -> str:
    mark = _STATE_MARK.get(run.state, "•")
    return (f"{mark} {run.run_id} {run.name[:40]} — {run.state}, "
            f"{run.steps_succeeded}/{run.steps_total} steps, {when(run.created_at, now)}")


def runs_text(runs: Sequence[RunSummary], user: str, now: float) -> str:
    if not runs:
        return f"{user} has no runs yet; /submit one."
    return f"Recent runs of {user}:\n" + "\n".join(run_line(r, now) for r in runs)


def submitted_text(run_id: str, plan: str) -> Message:
    return compose(f"Submitted: {run_id}\n/status {run_id}", plan)


def rejected_text(problems: str) -> Message:
    """The API's refusal of a pipeline, listed as `m27 submit` prints it."""
    return compose("Not submitted:", f"m27: {problems}")


def status_text(run: RunRecord, now: float) -> Message:
    took = format_duration((run.ended_at or now) - run.created_at)
    head = (f"{_STATE_MARK.get(run.state, '•')} {run.run_id} ({run.name}) by {run.user}: "
            f"{run.state} — {took}" + (f"\n{run.reason}" if run.reason else ""))
    lines = [_step_line(step, now) for step in run.steps[:MAX_LISTED]]
    if len(run.steps) > MAX_LISTED:
        lines.append(f"… and {len(run.steps) - MAX_LISTED} more steps")
    return compose(head, "\n".join(lines))


def _step_line(step: StepRecord, now: float) -> str:
    took = ""
    if step.started_at:
        took = " " + format_duration((step.ended_at or now) - step.started_at)
    where = f" on {step.node_id}" if step.node_id else ""
    code = f" exit {step.exit_code}" if step.exit_code is not None and step.exit_code else ""
    attempt = f" (attempt {step.attempt})" if step.attempt > 1 else ""
    return f"{step.name[:32]}: {step.state}{where}{code}{attempt}{took}"


def cancel_text(run_id: str, state: str) -> str:
    return f"{run_id}: cancel requested (the run is {state})."


def retry_text(run_id: str, state: str, steps: Sequence[str]) -> str:
    names = ", ".join(steps[:MAX_LISTED]) + (" …" if len(steps) > MAX_LISTED else "")
    return f"{run_id}: {len(steps)} step(s) will run again ({names}); the run is {state}."


def nodes_text(nodes: Sequence[NodeStatus]) -> Message:
    if not nodes:
        return compose("No node is registered.")
    lines = []
    for node in nodes[:MAX_LISTED]:
        sim = " (simulated)" if any(g.simulated for g in node.gpus) else ""
        lines.append(f"{node.node_id}: {node.state}, CPU {node.cpu_used}/{node.cpu_slots}, "
                     f"{len(node.gpus)} GPU{'s' if len(node.gpus) != 1 else ''}{sim}")
        lines.extend(f"  GPU {g.index}: {g.utilization_pct:.0f}% "
                     f"{g.memory_used_mb}/{g.memory_total_mb} MiB {g.temperature_c:.0f}°C"
                     + (f" — {', '.join(h.task_id for h in g.holdings)}"
                        if g.holdings else "")
                     for g in node.gpus)
    if len(nodes) > MAX_LISTED:
        lines.append(f"… and {len(nodes) - MAX_LISTED} more nodes")
    return compose(f"{len(nodes)} node(s):", "\n".join(lines))


def queue_text(items: Sequence[QueueItem], now: float) -> Message:
    if not items:
        return compose("The queue is empty: nothing waits or runs.")
    lines = []
    for item in items[:MAX_LISTED]:
        waited = format_duration(max(now - item.queued_at, 0.0)) if item.queued_at else ""
        where = f"on {item.node_id}" if item.node_id else item.reason
        lines.append(f"{item.task_id} [{item.user}] {item.state} {item.gpus:g} GPU "
                     f"{waited} — {where}".rstrip(" —"))
    if len(items) > MAX_LISTED:
        lines.append(f"… and {len(items) - MAX_LISTED} more")
    waiting = sum(i.state == "waiting" for i in items)
    return compose(f"{waiting} waiting, {len(items) - waiting} placed:", "\n".join(lines))


def subscribed_text(subscription: Subscription) -> str:
    runs = f" of runs matching {', '.join(subscription.runs)}" if subscription.runs else ""
    return (f"This chat now gets notices about {subscription.user}'s runs{runs}: "
            f"{', '.join(subscription.kinds)}. /unsubscribe stops them.")


def unsubscribed_text(had: bool) -> str:
    return ("This chat gets no more notices." if had
            else "This chat had no subscription.")


def report_caption(run: RunRecord, metrics: str) -> str:
    return cut(f"{run.run_id} ({run.name}): {run.state}" + (f"\n{metrics}" if metrics
                                                            else ""), CAPTION_LIMIT)


def no_report_text(run: RunRecord, path: str) -> str:
    if not path:
        return (f"{run.run_id} is {run.state}: its report is written when it ends."
                if run.state not in ("succeeded", "failed", "cancelled")
                else f"{run.run_id}: no report was written yet.")
    return (f"{run.run_id}: the report is at {path} on the m27 host (too large to send, "
            "or not readable by the bot).")


def run_buttons(run_id: str, ended: bool) -> tuple[tuple[str, str], ...]:
    """A run message's buttons: Status, Cancel (while it runs), Report."""
    buttons = [("Status", button_data("status", run_id))]
    if not ended:
        buttons.append(("Cancel", button_data("cancel", run_id)))
    buttons.append(("Report", button_data("report", run_id)))
    return tuple(buttons)


def with_buttons(message: Message, buttons: tuple[tuple[str, str], ...]) -> Message:
    return msgspec.structs.replace(message, buttons=buttons)


def failed_text(error: str, down: bool) -> str:
    """An API's refusal or absence, as one line."""
    first = (error.strip().splitlines() or ["no details"])[0][:300]
    return SYSTEM_DOWN.format(why=first) if down else first
