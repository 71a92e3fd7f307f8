"""Work per joule: from the program's `work.<unit>` counters and the step's GPU energy,
never estimated; simulated energy says so."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from m27.common.curves import Curve
from m27.report.efficiency import (
    NO_COUNTER,
    Efficiency,
    describe,
    efficiencies,
    format_rate,
    work_counters,
)


def curve(name: str, values: tuple[float, ...]) -> Curve:
    finite = [(v, i) for i, v in enumerate(values) if math.isfinite(v)]
    return Curve(step="train", name=name, steps=tuple(range(len(values))), values=values,
                 count=len(values), last=values[-1], last_step=len(values) - 1,
                 min=min(finite) if finite else None, max=max(finite) if finite else None)


def test_the_highest_finite_value_of_each_work_counter_is_the_total() -> None:
    curves = [curve("work.flops", (1e12, 2e12, math.nan, 3e12)), curve("loss", (1.0, 0.5)),
              curve("work.samples", (10.0, 20.0)), curve("work.", (5.0,)),
              curve("work.nothing", (math.nan,))]
    assert work_counters(curves) == {"flops": 3e12, "samples": 20.0}


def test_rates_read_as_the_lab_writes_them() -> None:
    flops = Efficiency(unit="flops", work=1.9e12 * 100, energy_j=100.0)
    assert format_rate(flops) == "1.9 TFLOP/J"  # TFLOPS/W
    assert format_rate(Efficiency(unit="samples", work=3400.0, energy_j=1.0)) == \
        "3.4 ksample/J"
    md = Efficiency(unit="ns", work=120.0, energy_j=1e6, simulated=True)
    assert format_rate(md) == "432 ns/kWh (simulated energy)"
    assert format_rate(Efficiency(unit="frames", work=5.0, energy_j=10.0)) == "0.5 frames/J"


def test_without_a_counter_it_says_so_and_without_energy_says_nothing() -> None:
    assert describe({}, 5000.0) == NO_COUNTER
    assert describe({"flops": 1e15}, None) == ""
    assert describe({"flops": 1e15}, 0.0) == ""
    assert describe({"flops": 2e15}, 1000.0) == "2 TFLOP/J"
    assert efficiencies({"flops": 1.0}, math.nan) == ()


@given(st.dictionaries(st.sampled_from(["flops", "samples", "ns", "x"]),
                       st.floats(0, 1e30)), st.floats(1e-3, 1e12), st.booleans())
def test_every_rate_is_work_over_energy_and_says_when_energy_is_modelled(
        counters: dict[str, float], energy: float, simulated: bool) -> None:
    rates = efficiencies(counters, energy, simulated=simulated)
    assert [e.unit for e in rates] == list(counters)
    for rate in rates:
        assert math.isclose(rate.per_joule * energy, counters[rate.unit], rel_tol=1e-9,
                            abs_tol=1e-300)
        assert format_rate(rate).endswith("(simulated energy)") == simulated
