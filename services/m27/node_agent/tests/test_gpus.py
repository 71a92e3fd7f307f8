"""GPU specs, the load tasks put on GPUs, and the simulated telemetry model (pure)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common.model import GpuInfo, GpuProcess, GpuSample, per_gpu_share
from m27.common.platform import Platform
from m27.node_agent._gpus import (
    SIM_BUSY_TEMP_C,
    SIM_IDLE_POWER_W,
    SIM_IDLE_TEMP_C,
    SIM_NAME,
    SIM_POWER_LIMIT_W,
    SIM_THROTTLE_TEMP_C,
    GpuSpec,
    Holding,
    TaskActivity,
    booked_activities,
    busy_fraction,
    gpu_loads,
    gpu_memory_mb,
    parse_gpu_spec,
    simulated_gpus,
    simulated_sample,
    simulated_samples,
    task_utilization_pct,
)


@pytest.mark.parametrize(("text", "expected"), [
    ("auto", GpuSpec(mode="auto")),
    (" AUTO ", GpuSpec(mode="auto")),
    ("none", GpuSpec(mode="none")),
    ("sim:2", GpuSpec(mode="sim", count=2, memory_mb=16384)),
    ("sim:1", GpuSpec(mode="sim", count=1, memory_mb=16384)),
    ("sim:2x16GiB", GpuSpec(mode="sim", count=2, memory_mb=16384)),
    ("SIM:4X80GB", GpuSpec(mode="sim", count=4, memory_mb=80 * 1024)),
    ("sim:3x512MiB", GpuSpec(mode="sim", count=3, memory_mb=512)),
    ("sim:1x1.5GiB", GpuSpec(mode="sim", count=1, memory_mb=1536)),
    ("sim:2x80GiB,model=A100-SXM4,driver=550.54.15,cuda=12.4",
     GpuSpec(mode="sim", count=2, memory_mb=80 * 1024, model="A100-SXM4",
             platform=Platform(driver="550.54.15", cuda="12.4"))),
    ("sim:1, cuda=11.8", GpuSpec(mode="sim", count=1, memory_mb=16384,
                                 platform=Platform(cuda="11.8"))),
])
def test_parse_gpu_spec_accepts_the_documented_forms(text: str, expected: GpuSpec) -> None:
    assert parse_gpu_spec(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("", "expected auto, none, sim:N"),
    ("nvml", "expected auto, none, sim:N"),
    ("sim", "expected auto, none, sim:N"),
    ("sim:", "expected auto, none, sim:N"),
    ("sim:-1", "expected auto, none, sim:N"),
    ("sim:two", "expected auto, none, sim:N"),
    ("sim:0", "use `none` for no GPUs"),
    ("sim:65", "1-64"),
    ("sim:2x", "bad GPU memory"),
    ("sim:2x16XB", "bad GPU memory"),
    ("sim:2x100", "at least 1MiB"),
    ("gpu:2", "expected auto, none, sim:N"),
    ("auto,cuda=12.4", "expected auto, none, sim:N"),
    ("sim:1,cuda=latest", "simulated cuda version must be dotted numbers"),
    ("sim:1,driver=", "expected auto, none, sim:N"),
    ("sim:1,colour=red", "expected auto, none, sim:N"),
    ("sim:1,cuda=12,cuda=11", "expected auto, none, sim:N"),
    ("sim:1,model=" + "x" * 65, "at most 64 characters"),
    ("sim:1,model=a\x00b", "printable"),
])
def test_parse_gpu_spec_rejects_anything_else_saying_why(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_gpu_spec(text)


def test_a_simulated_model_is_named_and_still_says_simulated() -> None:
    gpus = simulated_gpus("n1", parse_gpu_spec("sim:1,model=A100"))
    assert gpus[0].name == f"{SIM_NAME} (A100)"
    assert gpus[0].simulated


def test_simulated_gpus_are_labelled_simulated_in_every_field() -> None:
    gpus = simulated_gpus("n1", GpuSpec(mode="sim", count=2, memory_mb=8192))
    assert gpus == (
        GpuInfo(index=0, name=SIM_NAME, uuid="SIM-n1-0", memory_total_mb=8192, simulated=True),
        GpuInfo(index=1, name=SIM_NAME, uuid="SIM-n1-1", memory_total_mb=8192, simulated=True),
    )
    assert "simulated" in SIM_NAME


@pytest.mark.parametrize(("gpu_ids", "share", "expected"), [
    ((), 0.5, 0.0),
    ((0,), 0.5, 0.5),
    ((0,), 0.1, 0.1),
    ((0,), 0.0, 1.0),  # GPUs listed without a share: whole GPUs
    ((0,), 1.0, 1.0),
    ((0, 1), 2.0, 1.0),  # Resources.gpus style: two whole GPUs
    ((0, 1), 1.0, 1.0),
    ((0,), 3.0, 1.0),
])
def test_per_gpu_share(gpu_ids: tuple[int, ...], share: float, expected: float) -> None:
    assert per_gpu_share(gpu_ids, share) == pytest.approx(expected)


def test_gpu_loads_sum_the_shares_held_on_each_gpu() -> None:
    loads = gpu_loads([
        Holding(gpu_ids=(0,), gpu_share=0.5),
        Holding(gpu_ids=(0,), gpu_share=0.3),
        Holding(gpu_ids=(1, 2), gpu_share=2.0),
        Holding(gpu_ids=(), gpu_share=0.0),
    ])
    assert loads == pytest.approx({0: 0.8, 1: 1.0, 2: 1.0})


GPU = GpuInfo(index=0, name=SIM_NAME, uuid="SIM-n-0", memory_total_mb=16000, simulated=True)
MIB = 1024 * 1024


def activity(busy: float, share: float = 1.0, gpu_ids: tuple[int, ...] = (0,),
             rss: tuple[tuple[int, int], ...] = (), task: str = "r/s",
             measured: bool = True) -> TaskActivity:
    return TaskActivity(task_id=task, attempt=1, gpu_ids=gpu_ids, share=share, busy=busy,
                        rss=rss, measured=measured)


@pytest.mark.parametrize(("activities", "util"), [
    ([], 0.0),
    ([activity(0.0, share=0.5)], 0.0),  # sleeping (I/O): its share stays idle
    ([activity(1.0, share=0.5)], 50.0),  # busy: its whole share
    ([activity(0.4, share=0.5)], 20.0),
    ([activity(1.0, share=0.5), activity(1.0, share=0.3)], 80.0),
    ([activity(1.0), activity(1.0, share=0.5)], 100.0),  # capped
    ([activity(3.0)], 100.0),  # busy is a fraction: more than 1 counts as 1
    ([activity(1.0, gpu_ids=(1,))], 0.0),  # on another GPU
])
def test_simulated_utilization_is_share_times_what_the_task_does(
        activities: list[TaskActivity], util: float) -> None:
    assert simulated_sample(GPU, activities, None, 0.0).utilization_pct == util


def test_simulated_memory_is_the_resident_memory_of_the_tasks_processes() -> None:
    two_gpus = activity(1.0, gpu_ids=(0, 1), rss=((10, 400 * MIB), (11, 200 * MIB)),
                        task="r/a")
    one_gpu = activity(0.0, share=0.5, rss=((20, 1000 * MIB),), task="r/b")
    sample = simulated_sample(GPU, [two_gpus, one_gpu], None, 0.0)
    assert sample.processes == (
        GpuProcess(pid=10, memory_mb=200, task_id="r/a", attempt=1),  # spread over 2 GPUs
        GpuProcess(pid=11, memory_mb=100, task_id="r/a", attempt=1),
        GpuProcess(pid=20, memory_mb=1000, task_id="r/b", attempt=1),
    )
    assert sample.memory_used_mb == 1300
    assert sample.memory_total_mb == 16000


def test_memory_of_unmeasured_tasks_is_their_booked_share_and_never_over_the_gpu() -> None:
    assert simulated_sample(GPU, [activity(1.0, share=0.5, measured=False)], None,
                            0.0).memory_used_mb == 8000
    huge = activity(1.0, rss=((1, 10**6 * MIB),))
    assert simulated_sample(GPU, [huge], None, 0.0).memory_used_mb == 16000


def test_every_simulated_reading_says_simulated() -> None:
    sample = simulated_sample(GPU, [activity(1.0)], None, 0.0)
    assert sample.simulated
    assert sample.power_limit_w == SIM_POWER_LIMIT_W


def run(busy: float, samples: int, previous: GpuSample | None = None,
        dt: float = 5.0) -> list[GpuSample]:
    found = []
    for _ in range(samples):
        previous = simulated_sample(GPU, [activity(busy)], previous, dt)
        found.append(previous)
    return found


def test_simulated_temperature_rises_gradually_under_load_and_cools_when_idle() -> None:
    temps = [s.temperature_c for s in run(1.0, 60)]
    assert temps[0] == SIM_IDLE_TEMP_C
    assert all(b > a for a, b in itertools.pairwise(temps[1:21]))
    assert temps[1] - SIM_IDLE_TEMP_C == pytest.approx(0.3 * 50, abs=0.01), "30 % per 5 s"
    assert SIM_BUSY_TEMP_C - 1 < temps[-1] <= SIM_BUSY_TEMP_C
    hot = run(1.0, 60)[-1]
    cooled = [s.temperature_c for s in run(0.0, 10, hot)]
    assert all(b < a for a, b in itertools.pairwise([hot.temperature_c, *cooled]))


def test_the_thermal_step_scales_with_the_interval() -> None:
    """Two 2.5 s samples warm a GPU as much as one 5 s sample."""
    five = run(1.0, 2, dt=5.0)[-1].temperature_c
    half = run(1.0, 3, dt=2.5)[-1].temperature_c
    assert half == pytest.approx(five, abs=0.01)


def test_a_hot_gpu_throttles_thermal_and_a_full_one_at_its_power_limit() -> None:
    readings = run(1.0, 30)
    assert readings[0].throttle == ("power",)
    assert readings[0].power_w == SIM_POWER_LIMIT_W
    first_hot = next(i for i, s in enumerate(readings) if "thermal" in s.throttle)
    assert readings[first_hot].temperature_c >= SIM_THROTTLE_TEMP_C
    assert readings[first_hot - 1].temperature_c < SIM_THROTTLE_TEMP_C
    assert 5 <= first_hot <= 15
    half = run(0.5, 30)
    assert all(s.throttle == () for s in half)  # 60 °C and 170 W: neither limit
    assert half[-1].power_w == pytest.approx(SIM_IDLE_POWER_W + 0.5 * 260)


def test_simulated_energy_integrates_power_over_the_intervals() -> None:
    idle = run(0.0, 3)
    assert [s.energy_j for s in idle] == [0.0, 200.0, 400.0]  # 40 W x 5 s
    busy = simulated_sample(GPU, [activity(1.0)], idle[-1], 10.0)
    assert busy.energy_j == pytest.approx(400.0 + (40 + 300) / 2 * 10)


@given(busy=st.floats(min_value=-1, max_value=10, allow_nan=False),
       share=st.floats(min_value=0, max_value=1),
       previous_temp=st.floats(min_value=SIM_IDLE_TEMP_C, max_value=SIM_BUSY_TEMP_C),
       dt=st.floats(min_value=0, max_value=1e6, allow_nan=False),
       rss=st.integers(min_value=0, max_value=2**50))
def test_simulated_readings_stay_in_physical_bounds(busy: float, share: float,
                                                    previous_temp: float, dt: float,
                                                    rss: int) -> None:
    previous = GpuSample(index=0, utilization_pct=0, memory_used_mb=0,
                         temperature_c=previous_temp, power_w=40.0, energy_j=5.0)
    sample = simulated_sample(GPU, [activity(busy, share, rss=((7, rss),))], previous, dt)
    assert 0 <= sample.utilization_pct <= 100
    assert 0 <= sample.memory_used_mb <= GPU.memory_total_mb
    assert SIM_IDLE_TEMP_C - 0.01 <= sample.temperature_c <= SIM_BUSY_TEMP_C + 0.01
    assert SIM_IDLE_POWER_W <= (sample.power_w or 0) <= SIM_POWER_LIMIT_W
    assert (sample.energy_j or 0) >= 5.0


def test_simulated_samples_cover_every_gpu_in_order() -> None:
    gpus = simulated_gpus("n", GpuSpec(mode="sim", count=3, memory_mb=1000))
    samples = simulated_samples(gpus, [activity(1.0, share=0.5, gpu_ids=(1,))], {}, 0.0)
    assert [s.index for s in samples] == [0, 1, 2]
    assert [s.utilization_pct for s in samples] == [0.0, 50.0, 0.0]


@pytest.mark.parametrize(("cpu", "before", "dt", "age", "expected"), [
    (10.0, 5.0, 5.0, 100.0, 1.0),  # one full CPU since the last sample
    (10.0, 9.0, 5.0, 100.0, 0.2),
    (10.0, 10.0, 5.0, 100.0, 0.0),  # asleep
    (40.0, 10.0, 5.0, 100.0, 1.0),  # several cores: capped at one
    (5.0, 10.0, 5.0, 100.0, 0.0),  # a member left the group: never negative
    (2.0, None, 5.0, 4.0, 0.5),  # first sample: since the task started
    (2.0, None, 5.0, 0.0, 0.0),
    (2.0, 1.0, 0.0, 4.0, 0.0),
])
def test_busy_fraction(cpu: float, before: float | None, dt: float, age: float,
                       expected: float) -> None:
    assert busy_fraction(cpu, before, dt, age) == pytest.approx(expected)


def test_booked_activities_model_unmeasured_tasks_busy_at_their_share() -> None:
    found = booked_activities([Holding(gpu_ids=(0, 1), gpu_share=2.0),
                               Holding(gpu_ids=(), gpu_share=0.0)])
    assert found == [TaskActivity(task_id="", attempt=0, gpu_ids=(0, 1), share=1.0,
                                  busy=1.0, measured=False)]
    assert task_utilization_pct(found[0]) == 100.0


@pytest.mark.parametrize(("ids", "share", "requested", "expected"), [
    ((0,), 0.5, 0, 8000),
    ((0,), 0.5, 3000, 3000),
    ((0, 1), 1.0, 0, 12000),  # the smallest of the GPUs bounds it
    ((), 0.0, 0, 0),
    ((7,), 1.0, 0, 0),
])
def test_gpu_memory_mb(ids: tuple[int, ...], share: float, requested: int,
                       expected: int) -> None:
    gpus = (GpuInfo(index=0, name="a", uuid="a", memory_total_mb=16000, simulated=False),
            GpuInfo(index=1, name="b", uuid="b", memory_total_mb=12000, simulated=False))
    assert gpu_memory_mb(gpus, ids, share, requested) == expected
