"""The scheduler's Prometheus counters (pure): what it carried out, so thrash is visible.

`m27_scheduler_preemptions_total{kind}` counts the stops it sent for a preemption, by why:
`preemption` (room for a higher-scored task), `backfill-tenant` (a backfill inside a task
that is preempted, or one paused too long) and `drain` (moved off a draining node).
`m27_scheduler_decisions_total{type}` counts the policy's decisions that changed something
(a placement, a stop, a pause, ...; a repeated decision counts once). Both start at 0 for
every label value, so a rate is defined from the first scrape, and restart with the service.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

from m27.common.metrics import Kind, render_families, sample
from m27.scheduler.model import Decision, Pause, Place, Preempt, Resume, Stage, Wait

PreemptionKind = Literal["preemption", "backfill-tenant", "drain"]
DecisionType = Literal["place", "wait", "preempt", "pause", "resume", "stage"]

PREEMPTIONS: Final = "m27_scheduler_preemptions_total"
DECISIONS: Final = "m27_scheduler_decisions_total"
_FAMILIES: Final[dict[str, tuple[Kind, str]]] = {
    PREEMPTIONS: ("counter", "Preemptions the scheduler sent (checkpoint-then-stop), by kind."),
    DECISIONS: ("counter", "Scheduling decisions carried out, by type."),
}


def preemption_kind(decision: Preempt, lender: str) -> PreemptionKind:
    """A stop for no queued task is a drain; one of a backfill (it has a lender) frees its
    lender's capacity; any other makes room for a higher-scored task."""
    if not decision.for_task:
        return "drain"
    return "backfill-tenant" if lender else "preemption"


def decision_type(decision: Decision) -> DecisionType:
    match decision:
        case Place():
            return "place"
        case Wait():
            return "wait"
        case Preempt():
            return "preempt"
        case Pause():
            return "pause"
        case Resume():
            return "resume"
        case Stage():
            return "stage"


class SchedulerMetrics:
    """Counters since this scheduler started."""

    def __init__(self) -> None:
        self.preemptions: dict[str, int] = dict.fromkeys(get_args(PreemptionKind), 0)
        self.decisions: dict[str, int] = dict.fromkeys(get_args(DecisionType), 0)

    def preempted(self, kind: PreemptionKind) -> int:
        """Count one preemption; the number of them so far."""
        self.preemptions[kind] += 1
        return sum(self.preemptions.values())

    def decided(self, decision: Decision) -> None:
        self.decisions[decision_type(decision)] += 1

    def render(self) -> str:
        """The text a scrape of the scheduler's /metrics gets."""
        return render_families(_FAMILIES, {
            PREEMPTIONS: [sample(PREEMPTIONS, {"kind": k}, n)
                          for k, n in self.preemptions.items()],
            DECISIONS: [sample(DECISIONS, {"type": t}, n) for t, n in self.decisions.items()],
        })
