"""The training monitor's detector on recorded curves (a real torch training run and
hand-made ones) and on random ones (hypothesis)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common.model import MonitorSpec
from m27.common.training_monitor import Anomaly, MonitorState, observe, value_of


def run(values: Sequence[float], spec: MonitorSpec | None = None, first_step: int = 0
        ) -> list[Anomaly]:
    spec = spec or MonitorSpec()
    state, found = MonitorState(), list[Anomaly]()
    for step, value in enumerate(values, start=first_step):
        state, started = observe(state, spec, step, value)
        found += started
    return found


def kinds(found: Sequence[Anomaly]) -> list[tuple[str, int]]:
    return [(a.kind, a.step) for a in found]


@pytest.fixture(scope="module")
def recorded_loss() -> list[float]:
    """The per-batch loss of a real training run (a small MLP on a noisy regression
    problem, SGD with momentum, 400 steps, fixed seeds): a healthy curve, noisy at
    every step."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(7)
    x = torch.randn(4096, 16)
    y = (x @ torch.randn(16, 1)).sin() + 0.3 * torch.randn(4096, 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(400):
        batch = torch.randint(0, 4096, (64,))
        loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def test_a_healthy_recorded_run_raises_nothing_with_the_defaults(
        recorded_loss: list[float]) -> None:
    assert run(recorded_loss) == []
    assert run(recorded_loss, MonitorSpec(plateau=0, spike=4.0)) == []


def test_a_spike_in_a_recorded_run_is_found_at_its_step_and_once(
        recorded_loss: list[float]) -> None:
    curve = list(recorded_loss)
    for step in (250, 251, 252):  # one bad stretch of three batches
        curve[step] = curve[step] * 8
    found = run(curve)
    assert kinds(found) == [("spike", 250)]
    spike = found[0]
    assert spike.baseline is not None
    assert spike.value > 5 * spike.baseline
    assert "robust standard deviations above the median" in spike.detail


def test_a_recorded_run_that_diverges_then_goes_nan(recorded_loss: list[float]) -> None:
    curve = recorded_loss[:300] + [recorded_loss[299] * 1.5 ** k for k in range(1, 16)]
    curve += [math.inf, math.nan, math.nan]
    found = run(curve)
    # the first rise is already far outside the band; ten rises in a row is divergence
    assert kinds(found) == [("spike", 301), ("divergence", 309), ("nan", 315)]
    assert found[2].value == math.inf
    assert found[2].baseline is None


@pytest.mark.parametrize(("name", "values", "spec", "expected"), [
    ("flat then a jump", [1.0] * 20 + [1.5], MonitorSpec(), [("spike", 20)]),
    ("flat, a wiggle inside 1 % is no spike", [1.0] * 20 + [1.05], MonitorSpec(), []),
    ("a drop of a loss is good news", [1.0] * 20 + [0.1], MonitorSpec(), []),
    ("a drop of an accuracy is a spike", [0.9] * 20 + [0.5], MonitorSpec(mode="max"),
     [("spike", 20)]),
    ("too early to call a spike", [1.0] * 5 + [9.0], MonitorSpec(), []),
    ("spike detection off", [1.0] * 20 + [9.0], MonitorSpec(spike=0, divergence=0), []),
    ("a jump, back, a jump: one episode", [1.0] * 20 + [9.0, 9.0, 1.0, 9.0],
     MonitorSpec(divergence=0), [("spike", 20)]),
    ("an episode ends after `warmup` calm values", [1.0] * 20 + [9.0] + [1.0] * 10 + [9.0],
     MonitorSpec(divergence=0), [("spike", 20), ("spike", 31)]),
    ("NaN once per stretch", [1.0, math.nan, math.nan, 1.0, -math.inf], MonitorSpec(),
     [("nan", 1)]),
    ("NaN again after calm", [1.0, math.nan, *[1.0] * 3, math.inf], MonitorSpec(warmup=3),
     [("nan", 1), ("nan", 5)]),
    ("rising 3 times in a row", [5.0, 4.0, 4.1, 4.2, 4.3, 4.4, 3.0],
     MonitorSpec(divergence=3, spike=0), [("divergence", 4)]),
    ("divergence off", [float(v) for v in range(30)], MonitorSpec(divergence=0, spike=0), []),
    ("a plateau after 5 values without a new best", [3.0, 2.0, 2.0, 2.1, 2.0, 2.05, 2.0, 1.0],
     MonitorSpec(plateau=5, spike=0, divergence=0), [("plateau", 6)]),
    ("min_delta: a tiny gain is no new best",
     [2.0, 1.9999, 1.9998, 1.9997], MonitorSpec(plateau=3, min_delta=0.01, spike=0), [
         ("plateau", 3)]),
])
def test_table(name: str, values: list[float], spec: MonitorSpec,
               expected: list[tuple[str, int]]) -> None:
    assert kinds(run(values, spec)) == expected, name


def test_logged_strings_for_what_is_not_finite_are_values() -> None:
    assert math.isnan(value_of("NaN"))
    assert value_of("-Infinity") == -math.inf
    assert value_of(0.5) == 0.5


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
values_with_gaps = st.lists(st.one_of(finite, finite, finite, st.just(math.nan),
                                      st.just(math.inf)), max_size=120)
specs = st.builds(MonitorSpec, window=st.integers(2, 60), warmup=st.integers(1, 30),
                  spike=st.sampled_from([0.0, 2.0, 6.0]), divergence=st.integers(0, 8),
                  plateau=st.integers(0, 20), min_delta=st.sampled_from([0.0, 0.01]))


@given(values_with_gaps, specs)
def test_max_mode_on_negated_values_finds_the_same_anomalies(values: list[float],
                                                               spec: MonitorSpec) -> None:
    mirrored = msgspec.structs.replace(spec, mode="max")
    assert kinds(run([-v for v in values], mirrored)) == kinds(run(values, spec))


@given(st.lists(finite, unique=True, max_size=120), specs)
def test_a_curve_that_always_improves_is_never_abnormal(values: list[float],
                                                          spec: MonitorSpec) -> None:
    assert run(sorted(values, reverse=True), msgspec.structs.replace(spec, min_delta=0.0)) == []


def episode_starts(conditions: Sequence[tuple[int, bool]], calm: int) -> list[int]:
    """Steps where a condition starts an episode, which ends after `calm` values in a row
    without it (the detector's rule, written as a loop)."""
    starts, in_episode, quiet = [], False, 0
    for step, holds in conditions:
        if holds:
            if not in_episode:
                starts.append(step)
            in_episode, quiet = True, 0
        elif in_episode:
            quiet += 1
            in_episode = quiet < calm
    return starts


@given(values_with_gaps, specs)
def test_each_kind_fires_once_per_episode(values: list[float], spec: MonitorSpec) -> None:
    found = run(values, spec)
    assert len(found) <= len(values)
    calm = max(1, spec.warmup)
    assert [a.step for a in found if a.kind == "nan"] == episode_starts(
        [(i, not math.isfinite(v)) for i, v in enumerate(values)], calm)
    # divergence and plateau: runs over the finite values, of rises and of values that
    # are no new best
    rises = plateaus = 0
    previous: float | None = None
    best: float | None = None
    diverging, flat = [], []
    for step, value in enumerate(values):
        if not math.isfinite(value):
            continue
        rises = rises + 1 if previous is not None and value > previous else 0
        improved = best is None or value < best - spec.min_delta * abs(best)
        plateaus = 0 if improved else plateaus + 1
        diverging.append((step, spec.divergence > 0 and rises >= spec.divergence))
        flat.append((step, spec.plateau > 0 and plateaus >= spec.plateau))
        previous, best = value, value if improved else best
    assert [a.step for a in found if a.kind == "divergence"] == episode_starts(diverging, calm)
    assert [a.step for a in found if a.kind == "plateau"] == episode_starts(flat, calm)
