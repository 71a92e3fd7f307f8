"""The report service's decisions, as data: which events get a report, which API to ask.

Pure functions of their inputs, so the shell only fetches, renders, writes and announces.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Final

import msgspec

from m27.common import events, ids
from m27.common.model import TERMINAL_RUN_STATES, ServiceInfo

ORCHESTRATOR: Final = "orchestrator"


class ReportDecision(msgspec.Struct, frozen=True, kw_only=True):
    """Whether an event asks for a report, and why (for logs and tests)."""

    write: bool
    run_id: str
    reason: str


def decide(event: events.Event) -> ReportDecision:
    """A report is written when a run reaches a terminal state, and only then."""
    if not isinstance(event, events.RunStateChanged):
        run_id = getattr(event, "run_id", "")
        return ReportDecision(write=False, run_id=run_id if isinstance(run_id, str) else "",
                              reason=f"{events.tag_of(event)} is not a run state change")
    if event.state not in TERMINAL_RUN_STATES:
        return ReportDecision(write=False, run_id=event.run_id,
                              reason=f"run is {event.state}, not finished")
    if not ids.is_valid_name(event.run_id):
        # The id becomes a file name: never let one reach outside the report directory.
        return ReportDecision(write=False, run_id=event.run_id,
                              reason="run id is not usable as a file name")
    return ReportDecision(write=True, run_id=event.run_id, reason=f"run {event.state}")


def report_file(out_dir: Path, run_id: str) -> Path:
    """Where a run's report lives: `<out>/<run_id>.html`."""
    if not ids.is_valid_name(run_id):
        raise ValueError(f"not a safe run id for a file name: {run_id!r}")
    return out_dir / f"{run_id}.html"


def pick_orchestrator(services: Iterable[tuple[str, ServiceInfo]]) -> str | None:
    """The gRPC address of the newest registered orchestrator, or None when there is none."""
    return pick_service(services, ORCHESTRATOR)


def pick_service(services: Iterable[tuple[str, ServiceInfo]], name: str) -> str | None:
    """The gRPC address of the newest registered instance of service `name`, or None.

    A crashed instance leaves its registration behind; the most recently started one is
    the likeliest to be alive. Ties go to the smaller key, so the choice is stable.
    """
    candidates = [
        (-info.started_at, key, info.grpc_address)
        for key, info in services
        if key.startswith(f"{name}.") and info.grpc_address
    ]
    return min(candidates)[2] if candidates else None
