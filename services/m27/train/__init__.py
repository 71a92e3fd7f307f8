"""The training-side library: what a step's program calls to cooperate with m27.

    import m27.train
    m27.train.apply_gpu_limits()        # keep torch within this step's GPU share
    m27.train.report_phase("io")        # about to wait on storage: lend the GPU out
    ...
    m27.train.report_phase("compute")
    m27.train.log(step, loss=0.41, acc=0.83)   # metrics, non-blocking (docs/training.md)

    ckpt = m27.train.Checkpointer(model=model, optimizer=opt, every_steps=500)
    cursor = ckpt.resume() or m27.train.Cursor()   # exact resume: see docs/training.md

Everything reads the M27_* variables the node-agent sets, and works (harmlessly) outside
m27; the checkpointing names need torch and are imported on first use, so importing
this package never loads torch. `m27.train.precision` (mixed precision per GPU
generation) and `m27.train.hdf5` (resumable HDF5 shards, needs h5py) are submodules.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from m27.train._checkpointer import Checkpointer, Counters, SaveReport
    from m27.train._cursor import Cursor, ResumableSampler, epoch_order
    from m27.train._errors import CheckpointError, RestoreError, TrainError

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Counters",
    "Cursor",
    "RestoreError",
    "ResumableSampler",
    "SaveReport",
    "TrainError",
    "apply_gpu_limits",
    "epoch_order",
    "flush_metrics",
    "log",
    "log_to",
    "log_work",
    "report_phase",
]

_LAZY = {
    "Checkpointer": "_checkpointer", "Counters": "_checkpointer", "SaveReport": "_checkpointer",
    "Cursor": "_cursor", "ResumableSampler": "_cursor", "epoch_order": "_cursor",
    "CheckpointError": "_errors", "RestoreError": "_errors", "TrainError": "_errors",
}


def log(step: int, **scalars: float) -> None:
    """Record training step `step`'s scalars: `m27.train.log(120, loss=0.41, acc=0.83)`.
    Non-blocking; written to `$M27_METRICS_FILE` (docs/training.md, "Metrics")."""
    from m27.train import _metrics

    _metrics.log(step, **scalars)


def log_work(step: int, **totals: float) -> None:
    """Record the work done so far, cumulative, by unit: `m27.train.log_work(120,
    flops=3.1e15)`; the report shows work per joule of GPU energy with it."""
    from m27.train import _metrics

    _metrics.log_work(step, **totals)


def log_to(path: str | os.PathLike[str]) -> None:
    """Write metrics to `path`: outside m27, where nothing is written otherwise."""
    from m27.train import _metrics

    _metrics.log_to(path)


def flush_metrics(timeout: float = 5.0) -> bool:
    """Write every point logged so far now; False if not written within `timeout`."""
    from m27.train import _metrics

    return _metrics.flush(timeout)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'm27.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"m27.train.{module}"), name)


def apply_gpu_limits() -> list[int]:
    """Cap torch's CUDA allocator at this step's memory share on each visible GPU
    (`torch.cuda.set_per_process_memory_fraction` with `M27_GPU_MEMORY_FRACTION`).

    This is a limit torch keeps to itself (an allocation past it raises OOM in this
    process), not isolation: see docs/isolation.md. Returns the devices it was applied to."""
    fraction = os.environ.get("M27_GPU_MEMORY_FRACTION")
    if not fraction:
        return []
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    devices = list(range(torch.cuda.device_count()))
    for device in devices:
        torch.cuda.set_per_process_memory_fraction(float(fraction), device)
    return devices


def report_phase(phase: Literal["io", "compute"]) -> bool:
    """Tell the node-agent what the step is doing: in an `io` phase its GPU share is idle
    and may be lent to other work at once (instead of after several idle samples)."""
    target = os.environ.get("M27_PHASE_FILE")
    if not target:
        return False
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(phase)
    os.replace(tmp, path)
    return True
