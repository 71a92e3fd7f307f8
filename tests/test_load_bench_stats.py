"""The pure parts of bench/load.py: pipeline sizes, the ledger check, the RSS trend and
the leak verdict."""

from __future__ import annotations

import math
import os

import pytest

from bench.load import (
    check_ledger,
    load_pipeline,
    memory_mib,
    memory_verdict,
    percentile,
    run_sizes,
    trend_per_hour,
    windowed,
)
from m27.pipeline import load_pipeline as parse_pipeline


@pytest.mark.parametrize(("tasks", "per_run", "sizes"), [
    (10000, 20, [20] * 500),
    (45, 20, [20, 20, 5]),
    (42, 20, [20, 22]),  # a remainder too small for a pipeline joins the last one
    (3, 20, [3]),
])
def test_run_sizes_add_up_to_the_tasks(tasks: int, per_run: int, sizes: list[int]) -> None:
    assert run_sizes(tasks, per_run) == sizes
    assert sum(sizes) == tasks


@pytest.mark.parametrize("steps", [4, 5, 20, 101])
def test_a_load_pipeline_has_the_steps_asked_for(steps: int) -> None:
    spec = parse_pipeline(load_pipeline(7, steps))
    assert len(spec.steps) == steps
    assert {s.type for s in spec.steps} == {"cpu", "gpu"}


def test_the_ledger_check_finds_missing_doubled_retried_and_unexpected_steps() -> None:
    lines = ["r1 a t1 1", "r1 b t2 1", "r1 b t2 1", "r1 c t3 1", "r1 c t3 2", "r2 x t9 1",
             "garbage"]
    check = check_ledger(lines, ["r1 a", "r1 b", "r1 c", "r1 d"])
    assert (check.expected, check.recorded) == (4, 6)
    assert check.missing == ["r1 d"]
    assert check.doubled == ["r1 b"]
    assert check.retried == ["r1 c"]
    assert check.unexpected == ["r2 x"]
    assert not check.ok
    assert check_ledger(["r1 a t1 1"], ["r1 a"]).ok


def test_the_trend_is_the_least_squares_slope_per_hour() -> None:
    assert trend_per_hour([(0.0, 10.0), (1800.0, 15.0), (3600.0, 20.0)]) == pytest.approx(10.0)
    # deviations from the means (90 s, 2): Σ dt·dv = 120, Σ dt² = 18000 → 1/150 per second
    assert trend_per_hour([(0.0, 1.0), (60.0, 3.0), (120.0, 1.0), (180.0, 3.0)]) == \
        pytest.approx(24.0)
    assert trend_per_hour([(5.0, 1.0)]) == 0.0
    assert trend_per_hour([(5.0, 1.0), (5.0, 9.0)]) == 0.0


def test_steady_growth_after_the_warmup_is_a_suspected_leak() -> None:
    growing = [(t, 100.0 + t / 60, t / 10) for t in range(0, 3600, 30)]  # 60 MiB/h
    verdict = memory_verdict(growing, warmup_s=300, bound_mib_per_h=20)
    assert verdict.suspected_leak
    assert verdict.trend_mib_per_h == pytest.approx(60.0)
    assert verdict.cpu_pct == pytest.approx(10.0)
    assert (verdict.first_mib, verdict.max_mib) == (100.0, verdict.last_mib)


def test_growth_that_flattens_out_or_stays_in_the_warmup_is_not_a_leak() -> None:
    warming = [(t, 100.0 + min(t, 300) / 10, 0.0) for t in range(0, 3600, 30)]
    assert not memory_verdict(warming, warmup_s=300, bound_mib_per_h=20).suspected_leak
    filling = [(t, 100.0 + 40 * (1 - math.exp(-t / 600)), 0.0) for t in range(0, 3600, 30)]
    verdict = memory_verdict(filling, warmup_s=0, bound_mib_per_h=20)
    assert verdict.trend_mib_per_h > 20
    assert not verdict.suspected_leak


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.95), percentile(values, 1.0)) == \
        (50.0, 95.0, 100.0)
    assert math.isnan(percentile([], 0.5))


def test_a_soak_is_cut_into_windows_each_with_its_own_trend() -> None:
    """Growth for an hour, then flat: the second window says so, the whole run would not."""
    samples = [{"t": t, "processes": {"store": {"rss_mib": 70 + min(t, 3600) / 360},
                                      "gone": {"rss_mib": math.nan}}}
               for t in range(0, 4801, 20)]
    table = windowed(samples, [300, 3600, 4800])
    assert set(table) == {"store"}  # a process with no readings has no row
    assert table["store"]["at_mib"] == pytest.approx([70 + 300 / 360, 80, 80])
    first, second = table["store"]["trend_mib_per_h"]
    assert first == pytest.approx(10.0)
    assert second == pytest.approx(0.0, abs=1e-9)


def test_the_anonymous_part_has_its_own_windows_and_older_soaks_have_none() -> None:
    """RSS that grows only by pages of code read in (file-backed) is no leak: the
    anonymous part is windowed apart; a soak sampled before it was kept gives no rows."""
    samples = [{"t": t, "processes": {"agent": {"rss_mib": 80 + t / 360, "anon_mib": 50.0}}}
               for t in range(0, 3601, 20)]
    rss, anon = windowed(samples, [0, 3600]), windowed(samples, [0, 3600], "anon_mib")
    assert rss["agent"]["trend_mib_per_h"] == pytest.approx([10.0])
    assert anon["agent"]["at_mib"] == [50.0, 50.0]
    assert anon["agent"]["trend_mib_per_h"] == pytest.approx([0.0], abs=1e-9)
    older = [{"t": s["t"], "processes": {"agent": {"rss_mib": 80.0}}} for s in samples]
    assert windowed(older, [0, 3600], "anon_mib") == {}


def test_a_live_process_has_an_anonymous_part_within_its_rss() -> None:
    rss, peak, anon = memory_mib(os.getpid())
    assert 0 < anon <= rss <= peak
