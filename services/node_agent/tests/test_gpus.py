"""GPU specs, the load tasks put on GPUs, and the simulated telemetry model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common.model import GpuInfo, GpuSample
from m27.node_agent._gpus import (
    SIM_BUSY_TEMP_C,
    SIM_IDLE_TEMP_C,
    SIM_NAME,
    GpuSpec,
    Holding,
    gpu_loads,
    gpu_memory_mb,
    parse_gpu_spec,
    per_gpu_share,
    simulated_gpus,
    simulated_sample,
    simulated_samples,
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
])
def test_parse_gpu_spec_rejects_anything_else_saying_why(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_gpu_spec(text)


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


@pytest.mark.parametrize(("load", "util", "mem"), [
    (0.0, 0.0, 0), (0.5, 50.0, 8000), (1.0, 100.0, 16000), (1.7, 100.0, 16000),
])
def test_simulated_utilization_and_memory_follow_the_load(load: float, util: float,
                                                          mem: int) -> None:
    sample = simulated_sample(GPU, load, previous=None, dt_s=0.0)
    assert (sample.utilization_pct, sample.memory_used_mb) == (util, mem)
    assert sample.temperature_c == SIM_IDLE_TEMP_C
    assert sample.power_w is not None


def test_simulated_temperature_rises_gradually_under_load_and_cools_when_idle() -> None:
    temps = []
    previous: GpuSample | None = None
    for _ in range(60):
        previous = simulated_sample(GPU, 1.0, previous, dt_s=5.0)
        temps.append(previous.temperature_c)
    assert temps[0] == SIM_IDLE_TEMP_C
    assert all(b > a for a, b in itertools.pairwise(temps[1:21]))
    assert temps[1] - temps[0] < 15, "one sample must not jump most of the way"
    assert SIM_BUSY_TEMP_C - 1 < temps[-1] <= SIM_BUSY_TEMP_C
    cooled = simulated_sample(GPU, 0.0, previous, dt_s=5.0)
    assert cooled.temperature_c < temps[-1]


@given(load=st.floats(min_value=-1, max_value=10, allow_nan=False),
       previous_temp=st.floats(min_value=SIM_IDLE_TEMP_C, max_value=SIM_BUSY_TEMP_C),
       dt=st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_simulated_readings_stay_in_physical_bounds(load: float, previous_temp: float,
                                                    dt: float) -> None:
    previous = GpuSample(index=0, utilization_pct=0, memory_used_mb=0,
                         temperature_c=previous_temp)
    sample = simulated_sample(GPU, load, previous, dt)
    assert 0 <= sample.utilization_pct <= 100
    assert 0 <= sample.memory_used_mb <= GPU.memory_total_mb
    assert SIM_IDLE_TEMP_C - 0.01 <= sample.temperature_c <= SIM_BUSY_TEMP_C + 0.01


def test_simulated_samples_cover_every_gpu_in_order() -> None:
    gpus = simulated_gpus("n", GpuSpec(mode="sim", count=3, memory_mb=1000))
    samples = simulated_samples(gpus, {1: 0.5}, {}, 0.0)
    assert [s.index for s in samples] == [0, 1, 2]
    assert [s.utilization_pct for s in samples] == [0.0, 50.0, 0.0]


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
