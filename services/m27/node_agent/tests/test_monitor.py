"""The telemetry decisions, pure and table-driven: idle tasks, tasks over their GPU memory
share, energy per task, and leaked GPU memory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common.model import GpuProcess, GpuSample
from m27.node_agent._monitor import (
    EnergyMeter,
    IdleDetector,
    LeakWatch,
    OverShareWatch,
    Phase,
    TaskSample,
    leak_candidates,
    memory_limit_mb,
)

KEY = ("r/train", 1)


def task(util: float | None, phase: Phase = "", *, paused: bool = False, share: float = 0.5,
         gpu_ids: tuple[int, ...] = (0,), used: int = 0, limit: int = 8000) -> TaskSample:
    return TaskSample(key=KEY, gpu_ids=gpu_ids, share=share, utilization_pct=util,
                      phase=phase, paused=paused, memory_mb=dict.fromkeys(gpu_ids, used),
                      limit_mb=dict.fromkeys(gpu_ids, limit))


# ---------------------------------------------------------------- idle

IDLE, BUSY = "idle", "busy"


@pytest.mark.parametrize(("samples", "expected"), [
    # (utilization, phase) per sample → the decision after each ("" none, idle, busy)
    ([(50, "")] * 5, ["", "", "", "", ""]),
    ([(5, "")] * 5, ["", "", IDLE, "", ""]),  # the third sample under 10 %: idle, once
    ([(5, ""), (5, ""), (50, ""), (5, ""), (5, ""), (5, "")], ["", "", "", "", "", IDLE]),
    ([(5, "")] * 3 + [(50, ""), (50, "")], ["", "", IDLE, BUSY, ""]),  # busy again, once
    ([(10, "")] * 4, ["", "", "", ""]),  # at the threshold is not under it
    ([(90, "io"), (90, "io"), (90, "compute")], [IDLE, "", BUSY]),  # the reported phase wins
    ([(5, "io"), (5, "compute"), (5, ""), (50, "")], [IDLE, "", "", BUSY]),  # still under it
    ([(None, ""), (None, ""), (None, ""), (None, "")], ["", "", "", ""]),  # not measured
    ([(5, ""), (None, ""), (5, ""), (5, "")], ["", "", "", IDLE]),  # unknown: no count
])
def test_idle_after_n_samples_under_the_threshold_or_at_once_in_an_io_phase(
        samples: list[tuple[float | None, Phase]], expected: list[str]) -> None:
    detector = IdleDetector(threshold_pct=10, samples=3)
    got = []
    for util, phase in samples:
        decision = detector.observe(task(util, phase))
        got.append("" if decision is None else IDLE if decision.idle else BUSY)
    assert got == expected


def test_an_idle_decision_carries_the_free_capacity_and_why() -> None:
    detector = IdleDetector(threshold_pct=10, samples=1)
    idle = detector.observe(task(2.5, share=0.3, gpu_ids=(1, 2)))
    assert idle is not None
    assert (idle.idle, idle.idle_share, idle.gpu_ids, idle.utilization_pct, idle.reason) == (
        True, 0.3, (1, 2), 2.5, "gpu_idle")
    busy = detector.observe(task(70.0, share=0.3, gpu_ids=(1, 2)))
    assert busy is not None
    assert (busy.idle, busy.reason, busy.utilization_pct) == (False, "busy", 70.0)
    io = IdleDetector(10, 3).observe(task(80.0, "io"))
    assert io is not None
    assert io.reason == "io_phase"


def test_paused_tasks_and_cpu_tasks_are_not_watched() -> None:
    detector = IdleDetector(threshold_pct=10, samples=2)
    assert detector.observe(task(0.0)) is None
    assert detector.observe(task(0.0, paused=True)) is None  # SIGSTOPped: resets the count
    assert detector.observe(task(0.0)) is None
    assert detector.observe(task(0.0, gpu_ids=())) is None
    assert detector.observe(task(0.0)) is not None


def test_forgetting_a_task_starts_it_afresh() -> None:
    detector = IdleDetector(threshold_pct=10, samples=1)
    assert detector.observe(task(0.0)) is not None
    detector.forget(KEY)
    assert detector.observe(task(0.0)) is not None


# ---------------------------------------------------------------- over share


@pytest.mark.parametrize(("total", "share", "asked", "count", "over", "expected"), [
    (16000, 0.5, 0, 1, 1.0, 8000),
    (16000, 0.5, 0, 1, 1.5, 12000),
    (16000, 0.3, 0, 1, 1.0, 4800),
    (16000, 0.5, 6000, 1, 1.0, 6000),  # an explicit request wins
    (16000, 1.0, 6000, 2, 1.0, 3000),  # for all of its GPUs together
    (0, 0.5, 0, 1, 1.0, 0),  # size unknown: no limit
])
def test_memory_limit(total: int, share: float, asked: int, count: int, over: float,
                      expected: int) -> None:
    assert memory_limit_mb(total, share, asked, count, over) == expected


W, S = "warned", "stopped"


@pytest.mark.parametrize(("policy", "used", "expected"), [
    ("stop", [100, 200], [[], []]),
    ("stop", [9000, 9000, 9000, 9000], [[W], [], [S], []]),  # K = 3 in a row
    ("stop", [9000, 100, 9000, 9000, 9000], [[W], [], [W], [], [S]]),  # the count restarts
    ("warn", [9000] * 5, [[W], [], [], [], []]),  # warn only: never stopped
    ("stop", [8000, 8001], [[], [W]]),  # at the limit is not over it
])
def test_over_share_warns_first_and_stops_after_k_samples(
        policy: str, used: list[int], expected: list[list[str]]) -> None:
    watch = OverShareWatch(policy, samples=3)  # type: ignore[arg-type]
    got = [[d.action for d in watch.observe(task(50, used=mb))] for mb in used]
    assert got == expected


def test_over_share_names_the_worst_gpu_and_ignores_whole_gpu_tasks() -> None:
    watch = OverShareWatch("stop", samples=1)
    over = TaskSample(key=KEY, gpu_ids=(0, 1), share=0.5, utilization_pct=50,
                      memory_mb={0: 9000, 1: 12000}, limit_mb={0: 8000, 1: 8000})
    decisions = watch.observe(over)
    assert [(d.action, d.gpu_index, d.used_mb, d.limit_mb) for d in decisions] == [
        ("warned", 1, 12000, 8000), ("stopped", 1, 12000, 8000)]
    assert "12000 MB" in decisions[0].reason
    assert watch.observe(task(50, share=1.0, used=90000)) == []


# ---------------------------------------------------------------- energy


def gpu(index: int, energy_j: float | None, power_w: float | None = None) -> GpuSample:
    return GpuSample(index=index, utilization_pct=0, memory_used_mb=0, temperature_c=0,
                     energy_j=energy_j, power_w=power_w)


def test_task_energy_is_its_share_of_each_gpus_energy_delta() -> None:
    meter = EnergyMeter()
    half = TaskSample(key=("r/a", 1), gpu_ids=(0,), share=0.5, utilization_pct=0)
    both = TaskSample(key=("r/b", 1), gpu_ids=(0, 1), share=1.0, utilization_pct=0)
    meter.add([gpu(0, 1000.0), gpu(1, 50.0)], [half, both], now=0.0)
    assert meter.energy_j(("r/a", 1)) is None  # one reading: no interval yet
    meter.add([gpu(0, 1100.0), gpu(1, 250.0)], [half, both], now=5.0)
    meter.add([gpu(0, 1300.0), gpu(1, 250.0)], [half], now=10.0)
    assert meter.energy_j(("r/a", 1)) == pytest.approx(0.5 * 100 + 0.5 * 200)
    assert meter.energy_j(("r/b", 1)) == pytest.approx(100 + 200)
    assert meter.energy_j(("r/none", 1)) is None
    meter.forget(("r/a", 1))
    assert meter.energy_j(("r/a", 1)) is None


@pytest.mark.parametrize(("first", "second", "expected"), [
    (gpu(0, 100.0, 50.0), gpu(0, 150.0, 50.0), 50.0),  # the counter
    (gpu(0, None, 100.0), gpu(0, None, 200.0), 150.0 * 10),  # no counter: power x time
    (gpu(0, None, None), gpu(0, None, 200.0), 200.0 * 10),
    (gpu(0, 900.0, 100.0), gpu(0, 10.0, 100.0), 100.0 * 10),  # counter reset: power
    (gpu(0, None, None), gpu(0, None, None), None),  # nothing to go by
])
def test_energy_falls_back_to_power_times_time(first: GpuSample, second: GpuSample,
                                               expected: float | None) -> None:
    meter = EnergyMeter()
    whole = TaskSample(key=KEY, gpu_ids=(0,), share=1.0, utilization_pct=0)
    meter.add([first], [whole], now=0.0)
    meter.add([second], [whole], now=10.0)
    got = meter.energy_j(KEY)
    assert got == (None if expected is None else pytest.approx(expected))


@given(st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 1000)), min_size=2, max_size=20))
def test_energy_never_goes_down(readings: list[tuple[float, float]]) -> None:
    meter = EnergyMeter()
    whole = TaskSample(key=KEY, gpu_ids=(0,), share=0.7, utilization_pct=0)
    last = 0.0
    for i, (energy, power) in enumerate(readings):
        meter.add([gpu(0, energy, power)], [whole], now=i * 5.0)
        now = meter.energy_j(KEY) or 0.0
        assert now >= last
        last = now


# ---------------------------------------------------------------- leaks


def holding(index: int, *procs: tuple[int, int, str, int]) -> GpuSample:
    return GpuSample(index=index, utilization_pct=0, memory_used_mb=0, temperature_c=0,
                     processes=tuple(GpuProcess(pid=p, memory_mb=mb, task_id=t, attempt=a)
                                     for p, mb, t, a in procs))


def test_leak_candidates_are_processes_of_tasks_not_running() -> None:
    samples = [holding(0, (10, 100, "r/run", 1), (11, 50, "r/old", 1), (12, 10, "", 0)),
               holding(1, (11, 70, "r/old", 1), (13, 5, "r/run", 0))]
    assert leak_candidates(samples, {("r/run", 1)}) == {
        (0, ("r/old", 1)): {11: 50}, (1, ("r/old", 1)): {11: 70}, (1, ("r/run", 0)): {13: 5}}


@pytest.mark.parametrize(("ended", "env_node", "cleaned"), [
    ({("r/old", 1)}, {11: "n1", 12: "n1"}, True),
    (set(), {11: "n1", 12: "n1"}, False),  # not known to have ended here: left alone
    ({("r/old", 1)}, {11: "n1", 12: "n2"}, False),  # one is another node's
    ({("r/old", 1)}, {11: "n1", 12: None}, False),  # one's environment is unreadable
])
def test_a_leak_is_reported_once_and_cleaned_only_when_provably_ours(
        ended: set[tuple[str, int]], env_node: dict[int, str | None], cleaned: bool) -> None:
    watch = LeakWatch("n1", never={999})
    candidates = {(0, ("r/old", 1)): {11: 300, 12: 200}}
    assert watch.observe(candidates, ended, env_node) == []  # not confirmed yet
    [leak] = watch.observe(candidates, ended, env_node)
    assert (leak.gpu_index, leak.key, leak.pids, leak.memory_mb, leak.cleaned) == (
        0, ("r/old", 1), (11, 12), 500, cleaned)
    assert watch.observe(candidates, ended, env_node) == []  # once


@pytest.mark.parametrize("pid", [1, 999])
def test_pid_1_and_the_agent_are_never_cleaned(pid: int) -> None:
    watch = LeakWatch("n1", never={999}, confirm=1)
    [leak] = watch.observe({(0, ("r/old", 1)): {pid: 300}}, {("r/old", 1)}, {pid: "n1"})
    assert not leak.cleaned


def test_a_leak_that_went_and_came_back_is_reported_again() -> None:
    watch = LeakWatch("n1", never=(), confirm=1)
    candidates = {(0, ("r/old", 1)): {11: 300}}
    assert len(watch.observe(candidates, set(), {})) == 1
    assert watch.observe({}, set(), {}) == []
    assert len(watch.observe(candidates, set(), {})) == 1
