"""GPU backends as data: the `--gpus` spec, simulated GPUs and their telemetry model.

Everything here is pure. A simulated GPU is never mistaken for hardware: its records say
`simulated=True`, its name says so, its uuid starts with `SIM-`, and the node's backend is
"simulated".

The model reads what the tasks really do (their CPU use and resident memory, measured by
the backend in `/proc`): a task busy on the CPU keeps its share of the GPU busy, one that
sleeps or waits on I/O leaves it idle; its resident memory stands for its GPU memory.
Temperature follows the load with a lag, power follows it at once, and both throttle past
their limits, as hardware does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from m27.common.model import GpuInfo, GpuProcess, GpuSample, per_gpu_share
from m27.common.platform import Platform, parse_version
from m27.common.units import parse_size

MIB: Final = 1024 * 1024
SIM_NAME: Final = "m27 simulated GPU"
SIM_DEFAULT_MEMORY_MB: Final = 16 * 1024
SIM_MAX_GPUS: Final = 64
SIM_IDLE_TEMP_C: Final = 35.0
SIM_BUSY_TEMP_C: Final = 85.0
#: A simulated GPU's temperature closes this fraction of the gap to its target every
#: `SIM_THERMAL_STEP_S` (scaled for other intervals: 30 % per 5 s ≈ a 14 s time constant).
SIM_THERMAL_STEP: Final = 0.3
SIM_THERMAL_STEP_S: Final = 5.0
#: At or above this temperature a simulated GPU reports a thermal throttle.
SIM_THROTTLE_TEMP_C: Final = 83.0
SIM_IDLE_POWER_W: Final = 40.0
SIM_BUSY_POWER_W: Final = 300.0
SIM_POWER_LIMIT_W: Final = 300.0

GpuMode = Literal["auto", "none", "sim"]
_SPEC_HELP: Final = ("expected auto, none, sim:N or sim:NxMEM, optionally followed by "
                     ",model=NAME,driver=VERSION,cuda=VERSION (e.g. sim:2, sim:2x16GiB or "
                     "sim:2x80GiB,model=A100,driver=550.54.15,cuda=12.4)")
SIM_OPTIONS: Final = ("model", "driver", "cuda")
MAX_SIM_MODEL_CHARS: Final = 64


class GpuSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What `--gpus` asked for: detect (`auto`), no GPUs, or N simulated GPUs of MEM each
    (of a `model`, on a node claiming a `driver` and `cuda` version, for testing placement
    rules; the GPUs still say they are simulated)."""

    mode: GpuMode
    count: int = 0
    memory_mb: int = 0
    model: str = ""
    platform: Platform = Platform()


def _sim_options(text: str, options: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in options.split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or key not in SIM_OPTIONS or not value or key in found:
            raise ValueError(f"{_SPEC_HELP}, got {text!r}")
        if key == "model":
            if len(value) > MAX_SIM_MODEL_CHARS or not value.isprintable():
                raise ValueError(f"simulated GPU model must be printable and at most "
                                 f"{MAX_SIM_MODEL_CHARS} characters, got {text!r}")
        elif parse_version(value) is None:
            raise ValueError(f"simulated {key} version must be dotted numbers "
                             f"(e.g. 12.4), got {value!r} in {text!r}")
        found[key] = value
    return found


def parse_gpu_spec(text: str) -> GpuSpec:
    """`auto` | `none` | `sim:N` | `sim:NxMEM`, a `sim:` one optionally with
    `,model=…,driver=…,cuda=…`; ValueError saying what is accepted."""
    head, _, options = text.strip().partition(",")
    lowered = head.strip().lower()
    if lowered in ("auto", "none") and not options:
        return GpuSpec(mode="auto" if lowered == "auto" else "none")
    if not lowered.startswith("sim:"):
        raise ValueError(f"{_SPEC_HELP}, got {text!r}")
    extra = _sim_options(text, options)
    count_text, sep, memory_text = lowered[4:].partition("x")
    if not count_text.strip().isdigit():
        raise ValueError(f"{_SPEC_HELP}, got {text!r}")
    count = int(count_text)
    if not 1 <= count <= SIM_MAX_GPUS:
        raise ValueError(f"simulated GPU count must be 1-{SIM_MAX_GPUS} (use `none` for no "
                         f"GPUs), got {text!r}")
    memory_mb = SIM_DEFAULT_MEMORY_MB
    if sep:
        try:
            memory_mb = parse_size(memory_text) // MIB
        except ValueError as exc:
            raise ValueError(f"bad GPU memory in {text!r}: {exc}") from exc
        if memory_mb < 1:
            raise ValueError(f"simulated GPU memory must be at least 1MiB, got {text!r}")
    return GpuSpec(mode="sim", count=count, memory_mb=memory_mb, model=extra.get("model", ""),
                   platform=Platform(driver=extra.get("driver", ""),
                                     cuda=extra.get("cuda", "")))


def simulated_gpus(node_id: str, spec: GpuSpec) -> tuple[GpuInfo, ...]:
    """The GPUs a `sim:` spec stands for, labelled simulated in every field that can say so
    (a `model` is added to the name: "m27 simulated GPU (A100)")."""
    name = f"{SIM_NAME} ({spec.model})" if spec.model else SIM_NAME
    return tuple(
        GpuInfo(index=i, name=name, uuid=f"SIM-{node_id}-{i}",
                memory_total_mb=spec.memory_mb, simulated=True)
        for i in range(spec.count)
    )


# ---------------------------------------------------------------- load held by running tasks


class Holding(msgspec.Struct, frozen=True, kw_only=True):
    """The GPUs one running task holds: the ids and its share of each of them.

    `pgid` names its process group (its main pid), whose CPU use and memory the simulated
    backend measures; 0 (not known) models the task as busy with its booked share of memory.
    """

    gpu_ids: tuple[int, ...]
    gpu_share: float
    task_id: str = ""
    attempt: int = 0
    pgid: int = 0


def gpu_loads(holdings: Iterable[Holding]) -> dict[int, float]:
    """GPU index → the sum of the shares running tasks hold on it (may exceed 1)."""
    loads: dict[int, float] = {}
    for holding in holdings:
        share = per_gpu_share(holding.gpu_ids, holding.gpu_share)
        for index in holding.gpu_ids:
            loads[index] = loads.get(index, 0.0) + share
    return loads


def gpu_memory_mb(gpus: Sequence[GpuInfo], gpu_ids: Sequence[int], share: float,
                  requested_mb: int) -> int:
    """The memory a task may use on each GPU: its request, else its share of the smallest."""
    if requested_mb > 0:
        return requested_mb
    sizes = [g.memory_total_mb for g in gpus if g.index in set(gpu_ids)]
    if not sizes:
        return 0
    return int(min(sizes) * share)


# ---------------------------------------------------------------- simulated telemetry


@dataclass(frozen=True, slots=True)
class TaskActivity:
    """What one task does on its GPUs between two simulated samples.

    `busy`: the fraction of one CPU its processes used (0-1; sleeping or waiting on I/O is
    0). `rss`: (pid, resident bytes) of its processes, spread evenly over its GPUs.
    Not `measured` (no process group known): busy at its share, holding its share of memory.
    A process left over from an ended task is an activity with share 0: memory, no load.
    """

    task_id: str
    attempt: int
    gpu_ids: tuple[int, ...]
    share: float  # of each listed GPU
    busy: float
    rss: tuple[tuple[int, int], ...] = ()
    measured: bool = True


def busy_fraction(cpu_s: float, previous_cpu_s: float | None, dt_s: float,
                  age_s: float) -> float:
    """CPU seconds used per second, capped to 0-1: since the last sample, or — on a task's
    first sample — since it started (`age_s`)."""
    if previous_cpu_s is None:
        used, span = cpu_s, age_s
    else:
        used, span = cpu_s - previous_cpu_s, dt_s
    if span <= 0 or not math.isfinite(used):
        return 0.0
    return min(1.0, max(0.0, used / span))


def task_utilization_pct(activity: TaskActivity) -> float:
    """How much of its own share a task keeps busy (100: all of it)."""
    return round(min(max(activity.busy, 0.0), 1.0) * 100.0, 1)


def _gpu_processes(activities: Sequence[TaskActivity]) -> tuple[GpuProcess, ...]:
    found: list[GpuProcess] = []
    for activity in activities:
        spread = max(1, len(activity.gpu_ids))
        found.extend(GpuProcess(pid=pid, memory_mb=rss // spread // MIB,
                                task_id=activity.task_id, attempt=activity.attempt)
                     for pid, rss in activity.rss)
    return tuple(sorted(found, key=lambda p: p.pid))


def _temperature(target: float, previous: GpuSample | None, dt_s: float) -> float:
    if previous is None:
        return SIM_IDLE_TEMP_C
    steps = max(dt_s, 0.0) / SIM_THERMAL_STEP_S
    alpha = 1.0 - math.pow(1.0 - SIM_THERMAL_STEP, steps)
    return previous.temperature_c + (target - previous.temperature_c) * alpha


def _energy(power_w: float, previous: GpuSample | None, dt_s: float) -> float:
    """Energy since the agent started, integrating power over the interval (trapezoid)."""
    if previous is None or previous.energy_j is None:
        return 0.0
    before = previous.power_w if previous.power_w is not None else power_w
    return previous.energy_j + (before + power_w) / 2.0 * max(dt_s, 0.0)


def simulated_sample(gpu: GpuInfo, activities: Sequence[TaskActivity],
                     previous: GpuSample | None, dt_s: float) -> GpuSample:
    """The next reading of a simulated GPU, given what the tasks on it did.

    Utilization is the sum of share × busy over its tasks (capped at 100 %); memory used is
    what their processes hold (capped at the GPU's size); temperature moves from its
    previous value towards 35 °C idle … 85 °C busy, throttling ("thermal") from 83 °C;
    power is 40 W idle … 300 W busy, throttling ("power") at its 300 W limit.
    """
    on_gpu = [a for a in activities if gpu.index in a.gpu_ids]
    load = sum(a.share * min(max(a.busy, 0.0), 1.0) for a in on_gpu)
    busy = min(max(load, 0.0), 1.0)
    processes = _gpu_processes(on_gpu)
    booked = sum(gpu.memory_total_mb * a.share for a in on_gpu if not a.measured)
    memory = min(gpu.memory_total_mb, round(booked) + sum(p.memory_mb for p in processes))
    temperature = _temperature(SIM_IDLE_TEMP_C + (SIM_BUSY_TEMP_C - SIM_IDLE_TEMP_C) * busy,
                               previous, dt_s)
    power = min(SIM_POWER_LIMIT_W, SIM_IDLE_POWER_W + (SIM_BUSY_POWER_W - SIM_IDLE_POWER_W)
                * busy)
    throttle = (("thermal",) if temperature >= SIM_THROTTLE_TEMP_C else ()) + (
        ("power",) if power >= SIM_POWER_LIMIT_W else ())
    return GpuSample(
        index=gpu.index, utilization_pct=round(busy * 100.0, 1), memory_used_mb=memory,
        temperature_c=round(temperature, 2), power_w=round(power, 1),
        memory_total_mb=gpu.memory_total_mb, power_limit_w=SIM_POWER_LIMIT_W,
        throttle=throttle, energy_j=round(_energy(power, previous, dt_s), 3),
        processes=processes, simulated=True,
    )


def simulated_samples(gpus: Sequence[GpuInfo], activities: Sequence[TaskActivity],
                      previous: Mapping[int, GpuSample], dt_s: float) -> tuple[GpuSample, ...]:
    """One reading of every simulated GPU, given the tasks' activity and the last readings."""
    return tuple(simulated_sample(gpu, activities, previous.get(gpu.index), dt_s)
                 for gpu in gpus)


def booked_activities(holdings: Iterable[Holding]) -> list[TaskActivity]:
    """Tasks whose processes are not known: modelled busy at their share (the booking)."""
    return [TaskActivity(task_id=h.task_id, attempt=h.attempt, gpu_ids=h.gpu_ids,
                         share=per_gpu_share(h.gpu_ids, h.gpu_share), busy=1.0, measured=False)
            for h in holdings if h.gpu_ids]
