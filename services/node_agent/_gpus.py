"""GPU backends as data: the `--gpus` spec, simulated GPUs and their telemetry model.

Everything here is pure. A simulated GPU is never mistaken for hardware: its records say
`simulated=True`, its name says so, its uuid starts with `SIM-`, and the node's backend is
"simulated".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal

import msgspec

from m27.common.model import GpuInfo, GpuSample
from m27.common.units import parse_size

MIB: Final = 1024 * 1024
SIM_NAME: Final = "m27 simulated GPU"
SIM_DEFAULT_MEMORY_MB: Final = 16 * 1024
SIM_MAX_GPUS: Final = 64
SIM_IDLE_TEMP_C: Final = 35.0
SIM_BUSY_TEMP_C: Final = 80.0
#: How fast a simulated GPU's temperature follows its load (seconds to close ~63 % of the gap).
SIM_THERMAL_TAU_S: Final = 20.0
SIM_IDLE_POWER_W: Final = 30.0
SIM_BUSY_POWER_W: Final = 250.0

GpuMode = Literal["auto", "none", "sim"]
_SPEC_HELP: Final = "expected auto, none, sim:N or sim:NxMEM (e.g. sim:2 or sim:2x16GiB)"


class GpuSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What `--gpus` asked for: detect (`auto`), no GPUs, or N simulated GPUs of MEM each."""

    mode: GpuMode
    count: int = 0
    memory_mb: int = 0


def parse_gpu_spec(text: str) -> GpuSpec:
    """`auto` | `none` | `sim:N` | `sim:NxMEM`; ValueError saying what is accepted."""
    lowered = text.strip().lower()
    if lowered in ("auto", "none"):
        return GpuSpec(mode="auto" if lowered == "auto" else "none")
    if not lowered.startswith("sim:"):
        raise ValueError(f"{_SPEC_HELP}, got {text!r}")
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
    return GpuSpec(mode="sim", count=count, memory_mb=memory_mb)


def simulated_gpus(node_id: str, spec: GpuSpec) -> tuple[GpuInfo, ...]:
    """The GPUs a `sim:` spec stands for, labelled simulated in every field that can say so."""
    return tuple(
        GpuInfo(index=i, name=SIM_NAME, uuid=f"SIM-{node_id}-{i}",
                memory_total_mb=spec.memory_mb, simulated=True)
        for i in range(spec.count)
    )


# ---------------------------------------------------------------- load held by running tasks


class Holding(msgspec.Struct, frozen=True, kw_only=True):
    """The GPUs one running task holds: the ids and its share of each of them."""

    gpu_ids: tuple[int, ...]
    gpu_share: float


def per_gpu_share(gpu_ids: Sequence[int], gpu_share: float) -> float:
    """The share of each listed GPU a task holds.

    `gpu_share` is a fraction (0.1-1.0) of each GPU, or — as in `Resources.gpus` — the
    number of whole GPUs; 0 with GPUs listed means whole GPUs.
    """
    if not gpu_ids:
        return 0.0
    if gpu_share <= 0:
        return 1.0
    if gpu_share > 1:
        return min(1.0, gpu_share / len(gpu_ids))
    return gpu_share


def gpu_loads(holdings: Iterable[Holding]) -> dict[int, float]:
    """GPU index → the sum of the shares running tasks hold on it (may exceed 1)."""
    loads: dict[int, float] = {}
    for holding in holdings:
        share = per_gpu_share(holding.gpu_ids, holding.gpu_share)
        for index in holding.gpu_ids:
            loads[index] = loads.get(index, 0.0) + share
    return loads


# ---------------------------------------------------------------- simulated telemetry


def simulated_sample(gpu: GpuInfo, load: float, previous: GpuSample | None,
                     dt_s: float) -> GpuSample:
    """The next reading of a simulated GPU holding `load` (sum of shares).

    Utilization is the load (capped at 100 %), memory used is proportional to it, and the
    temperature moves from its previous value towards 35 °C idle … 80 °C busy with a
    first-order lag, so it rises and cools gradually from sample to sample.
    """
    busy = min(max(load, 0.0), 1.0)
    target = SIM_IDLE_TEMP_C + (SIM_BUSY_TEMP_C - SIM_IDLE_TEMP_C) * busy
    if previous is None:
        temperature = SIM_IDLE_TEMP_C
    else:
        alpha = 1.0 - math.exp(-max(dt_s, 0.0) / SIM_THERMAL_TAU_S)
        temperature = previous.temperature_c + (target - previous.temperature_c) * alpha
    return GpuSample(
        index=gpu.index,
        utilization_pct=round(busy * 100.0, 1),
        memory_used_mb=round(gpu.memory_total_mb * busy),
        temperature_c=round(temperature, 2),
        power_w=round(SIM_IDLE_POWER_W + (SIM_BUSY_POWER_W - SIM_IDLE_POWER_W) * busy, 1),
    )


def simulated_samples(gpus: Sequence[GpuInfo], loads: Mapping[int, float],
                      previous: Mapping[int, GpuSample], dt_s: float) -> tuple[GpuSample, ...]:
    """One reading of every simulated GPU, given the loads and the last readings."""
    return tuple(
        simulated_sample(gpu, loads.get(gpu.index, 0.0), previous.get(gpu.index), dt_s)
        for gpu in gpus
    )


def gpu_memory_mb(gpus: Sequence[GpuInfo], gpu_ids: Sequence[int], share: float,
                  requested_mb: int) -> int:
    """The memory a task may use on each GPU: its request, else its share of the smallest."""
    if requested_mb > 0:
        return requested_mb
    sizes = [g.memory_total_mb for g in gpus if g.index in set(gpu_ids)]
    if not sizes:
        return 0
    return int(min(sizes) * share)
