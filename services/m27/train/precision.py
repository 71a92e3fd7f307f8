"""Mixed precision with the lab's defaults per GPU generation.

    prec = m27.train.precision.for_device()          # decides from the GPU it runs on
    with prec.autocast():
        loss = model(x)
    prec.scaler.scale(loss).backward()               # a no-op scaler unless fp16
    prec.scaler.step(optimizer)
    prec.scaler.update()

- compute capability ≥ 8.0 (Ampere and newer): bf16 autocast, no loss scaling (bf16 has
  fp32's exponent range, so gradients do not underflow);
- 7.x (Volta, Turing): fp16 autocast with a GradScaler;
- 6.x (Pascal): fp32, unless fp16 is asked for (Pascal has no tensor cores: fp16 saves
  memory but is rarely faster, and its narrow range costs skipped steps);
- no GPU: fp32 (bf16 on request).

When fp16 is chosen, the scaler uses the lab's settings for that generation (initial scale
/ growth interval / max scale): Pascal 8192 / 2000 / 32768, Volta and Turing
16384 / 1000 / 65536, Ampere and newer 32768 / 500 / 131072. PyTorch's GradScaler defaults
are 65536 / 2000 with no maximum: the first steps overflow and are skipped until the
scale has halved down to what the model tolerates, and the scale then keeps doubling every
growth interval until it overflows again, skipping a step each time. A lower initial scale
fits the range fp16 gradients actually have on each generation, and a maximum stops the
growth a few doublings above where it is useful, so overflows (skipped steps) stay rare.
The scaler's state (current scale, growth tracker) is always checkpointed: a resumed run
that restarted from the initial scale would skip steps again and would not be an exact
continuation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

Mode = Literal["bf16", "fp16", "fp32"]
Prefer = Literal["auto", "bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class ScalerSettings:
    init_scale: float
    growth_interval: int
    max_scale: float


#: The lab's loss-scaling settings, by GPU generation.
SETTINGS: dict[str, ScalerSettings] = {
    "pascal": ScalerSettings(8192.0, 2000, 32768.0),
    "volta": ScalerSettings(16384.0, 1000, 65536.0),
    "ampere": ScalerSettings(32768.0, 500, 131072.0),
}


@dataclass(frozen=True)
class Plan:
    """What precision to train in, and why."""

    mode: Mode
    generation: str  # "pascal", "volta", "turing", "ampere", "hopper", ..., "cpu"
    scaler: ScalerSettings | None  # loss scaling (fp16 only)
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.mode]


def generation(capability: tuple[int, int] | None) -> str:
    if capability is None:
        return "cpu"
    major, minor = capability
    if major >= 10:
        return "blackwell"
    return {9: "hopper", 8: "ampere", 7: "turing" if minor >= 5 else "volta",
            6: "pascal"}.get(major, "older")


def _settings(gen: str) -> ScalerSettings:
    if gen in ("volta", "turing"):
        return SETTINGS["volta"]
    if gen in ("pascal", "older"):
        return SETTINGS["pascal"]
    return SETTINGS["ampere"]  # Ampere and everything newer


def choose(capability: tuple[int, int] | None, prefer: Prefer = "auto") -> Plan:
    """The precision for a device of this compute capability (None: no GPU). Pure."""
    gen = generation(capability)
    if prefer == "fp32":
        return Plan("fp32", gen, None, "fp32 asked for")
    if prefer == "bf16":
        if capability is not None and capability < (8, 0):
            return Plan("fp32", gen, None, f"bf16 asked for, but {gen} has no bf16 support")
        return Plan("bf16", gen, None, "bf16 asked for")
    if prefer == "fp16":
        return Plan("fp16", gen, _settings(gen), f"fp16 asked for: {gen} loss-scale settings")
    if capability is None:
        return Plan("fp32", gen, None, "no GPU: fp32")
    if capability >= (8, 0):
        return Plan("bf16", gen, None, f"{gen} (sm {capability[0]}{capability[1]}): bf16, "
                    "no loss scaling needed")
    if capability >= (7, 0):
        return Plan("fp16", gen, _settings(gen),
                    f"{gen}: fp16 with loss scaling (no bf16 before Ampere)")
    return Plan("fp32", gen, None, f"{gen}: fp32 (fp16 only on request: no tensor cores)")


class GradScaler(torch.amp.GradScaler):
    """torch's GradScaler with a maximum scale (kept on the device: no synchronization)."""

    def __init__(self, device: str = "cuda", *, init_scale: float = 65536.0,
                 growth_interval: int = 2000, max_scale: float | None = None,
                 enabled: bool = True) -> None:
        super().__init__(device, init_scale=init_scale, growth_interval=growth_interval,
                         enabled=enabled)
        self.max_scale = max_scale

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(new_scale)
        if self._enabled and self.max_scale is not None and self._scale is not None:
            self._scale.clamp_(max=self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = super().state_dict()
        if state and self.max_scale is not None:
            state["max_scale"] = self.max_scale
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.max_scale = state.pop("max_scale", self.max_scale)
        super().load_state_dict(state)


@dataclass
class Precision:
    """A plan applied: autocast for the forward pass and a scaler for the backward."""

    plan: Plan
    device_type: str
    scaler: GradScaler

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.plan.mode == "fp32":
            yield
            return
        with torch.autocast(self.device_type, dtype=self.plan.dtype):
            yield


def capability_of(device: torch.device | int | None = None) -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    if isinstance(device, torch.device) and device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return (int(major), int(minor))


def for_device(device: torch.device | int | None = None, prefer: Prefer = "auto"
               ) -> Precision:
    """The lab's precision for `device` (default: the current CUDA device, else the CPU).
    The scaler is always a GradScaler — disabled unless fp16 — so the same loop code
    works in every mode and its state is always checkpointed."""
    capability = capability_of(device)
    plan = choose(capability, prefer)
    device_type = "cuda" if capability is not None else "cpu"
    settings = plan.scaler
    scaler = GradScaler(
        device_type, enabled=settings is not None,
        init_scale=settings.init_scale if settings else 65536.0,
        growth_interval=settings.growth_interval if settings else 2000,
        max_scale=settings.max_scale if settings else None)
    return Precision(plan, device_type, scaler)
