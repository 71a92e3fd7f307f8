"""The scheduler's Prometheus counters (pure): what it carried out, so thrash is visible.

`m27_scheduler_preemptions_total{kind}` counts the stops it sent for a preemption, by why:
`preemption` (room for a higher-scored task), `backfill-tenant` (a backfill inside a task
that is preempted, or one paused too long) and `drain` (moved off a draining node).
`m27_scheduler_decisions_total{type}` counts the policy's decisions that changed something
(a placement, a stop, a pause, ...; a repeated decision counts once). Both start at 0 for
every label value, so a rate is defined from the first scrape, and restart with the service.
`m27_scheduler_cycles_total` and `m27_scheduler_cycle_seconds_total` count scheduling cycles
and the time they took (their ratio between two scrapes is the mean cycle time then);
`m27_scheduler_cycle_seconds_max` is the longest cycle since the service started.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

from m27.common.metrics import Kind, render_families, sample
from m27.scheduler.model import Decision, Pause, Place, Preempt, Resume, Stage, Wait

PreemptionKind = Literal["preemption", "backfill-tenant", "drain"]
DecisionType = Literal["place", "wait", "preempt", "pause", "resume", "stage"]

PREEMPTIONS: Final = "m27_scheduler_preemptions_total"
DECISIONS: Final = "m27_scheduler_decisions_total"
CYCLES: Final = "m27_scheduler_cycles_total"
CYCLE_SECONDS: Final = "m27_scheduler_cycle_seconds_total"
CYCLE_MAX: Final = "m27_scheduler_cycle_seconds_max"
_FAMILIES: Final[dict[str, tuple[Kind, str]]] = {
    PREEMPTIONS: ("counter", "Preemptions the scheduler sent (checkpoint-then-stop), by kind."),
    DECISIONS: ("counter", "Scheduling decisions carried out, by type."),
    CYCLES: ("counter", "Scheduling cycles run."),
    CYCLE_SECONDS: ("counter", "Seconds spent in scheduling cycles."),
    CYCLE_MAX: ("gauge", "The longest scheduling cycle since the service started, seconds."),
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
        self.cycles = 0
        self.cycle_seconds = 0.0
        self.cycle_max = 0.0

    def preempted(self, kind: PreemptionKind) -> int:
        """Count one preemption; the number of them so far."""
        self.preemptions[kind] += 1
        return sum(self.preemptions.values())

    def decided(self, decision: Decision) -> None:
        self.decisions[decision_type(decision)] += 1

    def cycled(self, seconds: float) -> None:
        """Count one scheduling cycle that took `seconds`."""
        self.cycles += 1
        self.cycle_seconds += seconds
        self.cycle_max = max(self.cycle_max, seconds)

    def render(self) -> str:
        """The text a scrape of the scheduler's /metrics gets."""
        return render_families(_FAMILIES, {
            PREEMPTIONS: [sample(PREEMPTIONS, {"kind": k}, n)
                          for k, n in self.preemptions.items()],
            DECISIONS: [sample(DECISIONS, {"type": t}, n) for t, n in self.decisions.items()],
            CYCLES: [sample(CYCLES, {}, self.cycles)],
            CYCLE_SECONDS: [sample(CYCLE_SECONDS, {}, self.cycle_seconds)],
            CYCLE_MAX: [sample(CYCLE_MAX, {}, self.cycle_max)],
        })
