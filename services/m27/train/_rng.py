"""Every random number generator a training step draws from: Python's `random`, numpy's
legacy global generator, torch's CPU generator and the generator of every CUDA device.

CUDA states are only read when CUDA is already initialized in this process (reading
them would otherwise initialize CUDA in a program that never used it); they are restored
lazily (torch applies them when CUDA initializes).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The generator states now (cheap: a few kilobytes, copied)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put every generator back as `capture` saw it."""
    random.setstate(_python_state(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        for device, device_state in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(device_state.cpu(), device)


def _python_state(value: Any) -> tuple[Any, ...]:
    # random.setstate wants (version, tuple_of_ints, gauss_next) with a tuple inside.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)
