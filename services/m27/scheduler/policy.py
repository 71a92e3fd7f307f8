"""Placement policy (pure): `decide(state, queue, now, settings) -> decisions`, each with its
reason, and `explain` for one task (docs/scheduling.md).

This module is the policy's public face: the service, the simulator and the benchmarks call
these names. The core lives in `_core` and its helpers (`_packing`, `_preemption`,
`_backfill`, `_priority`, `_reasons`) over the structs of `m27.scheduler.model`.
"""

from __future__ import annotations

from m27.scheduler._core import Explanation, decide, explain, protection
from m27.scheduler._packing import Packer, Request, request_of, typical_demand
from m27.scheduler._priority import Score

__all__ = [
    "Explanation", "Packer", "Request", "Score", "decide", "explain", "protection",
    "request_of", "typical_demand",
]
