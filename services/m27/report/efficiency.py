"""Work per joule of a step (pure): what the program says it did over the energy its GPUs
used — the lab's "TFLOPS/W", which is TFLOP per joule.

NVML counts energy, not work: the work comes from the program, as cumulative counters it
logs as metrics named `work.<unit>` (`m27.train.log_work(step, flops=…)`, or a
`"work.ns": …` field in a metrics file: FLOPs, samples, tokens, nanoseconds of MD). A
counter's highest finite value is the step's total. A step with energy and no counter says
so ("no work counter"); nothing here estimates work from utilisation or clocks. Energy from
simulated GPUs is modelled, and so is a ratio with it: it says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Final

import msgspec

from m27.common.curves import Curve

WORK_PREFIX: Final = "work."
NO_COUNTER: Final = "no work counter"
#: Short names for the units programs count most (the rest are shown as they are named).
UNIT_NAMES: Final[dict[str, str]] = {"flops": "FLOP", "flop": "FLOP", "samples": "sample",
                                     "tokens": "token", "ns": "ns", "steps": "step"}
_PREFIXES: Final = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"),
                    (1e3, "k"))
#: Below this many units per joule the rate reads better per kilowatt-hour.
_PER_KWH_BELOW: Final = 0.01
J_PER_KWH: Final = 3.6e6


class Efficiency(msgspec.Struct, frozen=True, kw_only=True):
    """One work counter of a step over its GPU energy."""

    unit: str  # as logged after `work.`: "flops", "samples", …
    work: float
    energy_j: float
    simulated: bool = False  # the energy is modelled (simulated GPUs)

    @property
    def per_joule(self) -> float:
        return self.work / self.energy_j


def work_counters(curves: Iterable[Curve]) -> dict[str, float]:
    """unit → total, from the step's `work.<unit>` metrics (those with a finite value)."""
    found: dict[str, float] = {}
    for curve in curves:
        unit = curve.name[len(WORK_PREFIX):]
        if curve.name.startswith(WORK_PREFIX) and unit and curve.max is not None:
            found[unit] = curve.max[0]
    return dict(sorted(found.items()))


def efficiencies(counters: Mapping[str, float], energy_j: float | None, *,
                 simulated: bool = False) -> tuple[Efficiency, ...]:
    """Work per joule for each counter; () without energy (a CPU step, no readings)."""
    if not energy_j or energy_j <= 0 or not math.isfinite(energy_j):
        return ()
    return tuple(Efficiency(unit=unit, work=work, energy_j=energy_j, simulated=simulated)
                 for unit, work in counters.items() if work >= 0)


def unit_label(unit: str) -> str:
    return UNIT_NAMES.get(unit.lower(), unit)


def format_rate(efficiency: Efficiency) -> str:
    """`1.9 TFLOP/J`, `3.4 ksample/J`, `430 ns/kWh` (tiny rates per kWh), with
    "(simulated energy)" where the joules are modelled."""
    unit = unit_label(efficiency.unit)
    rate, per = efficiency.per_joule, "J"
    if 0 < rate < _PER_KWH_BELOW:
        rate, per = rate * J_PER_KWH, "kWh"
    prefix = ""
    for scale, name in _PREFIXES:
        if rate >= scale:
            rate, prefix = rate / scale, name
            break
    text = f"{rate:.3g} {prefix}{unit}/{per}"
    return text + (" (simulated energy)" if efficiency.simulated else "")


def describe(counters: Mapping[str, float], energy_j: float | None, *,
             simulated: bool = False) -> str:
    """The report's cell: the rates, "no work counter" when there is energy but no counter,
    "" when there is no energy (nothing to divide by)."""
    rates = efficiencies(counters, energy_j, simulated=simulated)
    if rates:
        return ", ".join(format_rate(e) for e in rates)
    return NO_COUNTER if energy_j and energy_j > 0 else ""
