"""The training-side library: what a step's program calls to cooperate with m27.

    import m27.train
    m27.train.apply_gpu_limits()        # keep torch within this step's GPU share
    m27.train.report_phase("io")        # about to wait on storage: lend the GPU out
    ...
    m27.train.report_phase("compute")

Everything reads the M27_* variables the node-agent sets, and does nothing (harmlessly)
outside m27 or without torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

__all__ = ["apply_gpu_limits", "report_phase"]


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
