"""Driving maintenance windows (pure): one record per node in KV `m27_windows`, moved
through its phases by `advance`; the service carries out the effects it returns.

scheduled ─(its start)→ draining ─(node empty)→ running ─(command done)→ scheduled
                            │                       │
                            └─(not empty in time)─┐ └─(no answer in time)─┐
                                                  └──→ failed: scheduled again, node cordoned

- draining: the node is cordoned and evacuated — checkpointing work checkpoints and moves,
  the rest is stopped and runs again elsewhere (requeued as a preemption);
- running: the command was sent to the node-agent once (at most once: an agent that dies
  meanwhile is timed out);
- succeeded: the node is uncordoned; failed: it stays cordoned for a person to look.
Either way the record moves on to its next occurrence, or is removed (a `once` window).
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from m27.common.windows import Window, occurrence_after

Phase = Literal["scheduled", "draining", "running"]
#: How long a window waits for its node to empty before it gives up (tasks are stopped
#: with their grace period, so this is only reached when something is stuck).
DRAIN_LIMIT_S: Final = 1800.0
#: Past the command's own time limit, how long the agent has to answer.
ANSWER_MARGIN_S: Final = 60.0


class WindowRecord(msgspec.Struct, frozen=True, kw_only=True):
    window: Window
    next_at: float | None  # the next occurrence's start; None: nothing more to do
    phase: Phase = "scheduled"
    occurrence: float = 0.0  # the occurrence in progress (draining, running)
    phase_since: float = 0.0
    runs: int = 0  # occurrences that ran their command to success
    last: str = ""  # how the last occurrence ended, in words


Effect = Literal["drain", "run", "uncordon", "report_failed", "report_succeeded"]


class Step(msgspec.Struct, frozen=True, kw_only=True):
    record: WindowRecord | None  # None: remove it
    effects: tuple[Effect, ...] = ()
    detail: str = ""


def scheduled(window: Window, now: float) -> WindowRecord | None:
    """A new window's record: its first occurrence at or after `now` (None: none left)."""
    start = occurrence_after(window, now)
    return None if start is None else WindowRecord(window=window, next_at=start)


def window_in_s(record: WindowRecord, now: float) -> float | None:
    """Seconds until the window starts when that is within its lead (0 once it runs);
    None otherwise: no placement rule applies yet."""
    if record.phase != "scheduled":
        return 0.0
    if record.next_at is None or record.next_at - now > record.window.lead_s:
        return None
    return max(0.0, record.next_at - now)


def _ended(record: WindowRecord, now: float, outcome: str) -> WindowRecord | None:
    following = occurrence_after(record.window, record.occurrence + 1.0)
    if following is None:
        return None
    return msgspec.structs.replace(record, next_at=following, phase="scheduled",
                                   occurrence=0.0, phase_since=now, last=outcome)


def advance(record: WindowRecord, now: float, *, tasks_on_node: int) -> Step:
    """What the passing of time does to `record` (the command's answer: `finished`)."""
    if record.phase == "scheduled":
        if record.next_at is None or now < record.next_at:
            return Step(record=record)
        return Step(record=msgspec.structs.replace(
            record, phase="draining", occurrence=record.next_at, phase_since=now),
            effects=("drain",))
    if record.phase == "draining":
        if tasks_on_node == 0:
            return Step(record=msgspec.structs.replace(record, phase="running",
                                                       phase_since=now), effects=("run",))
        if now - record.phase_since > DRAIN_LIMIT_S:
            detail = (f"{tasks_on_node} task(s) still on the node after "
                      f"{DRAIN_LIMIT_S:.0f} s: the command was not run")
            return Step(record=_ended(record, now, f"failed: {detail}"),
                        effects=("report_failed",), detail=detail)
        return Step(record=record)
    if now - record.phase_since > record.window.timeout_s + ANSWER_MARGIN_S:
        detail = "no answer from the node-agent within the command's time limit"
        return Step(record=_ended(record, now, f"failed: {detail}"),
                    effects=("report_failed",), detail=detail)
    return Step(record=record)


def finished(record: WindowRecord, now: float, *, occurrence: float,
             exit_code: int | None, error: str) -> Step | None:
    """The node-agent's answer; None when it is not about the occurrence in progress (a
    late or repeated answer)."""
    if record.phase != "running" or occurrence != record.occurrence:
        return None
    if exit_code == 0 and not error:
        after = _ended(record, now, "succeeded")
        if after is not None:
            after = msgspec.structs.replace(after, runs=record.runs + 1)
        return Step(record=after, effects=("uncordon", "report_succeeded"))
    detail = error or f"the command exited with {exit_code}"
    return Step(record=_ended(record, now, f"failed: {detail}"), effects=("report_failed",),
                detail=detail)
