"""Mixed precision per GPU generation, with the lab's loss-scale settings."""

from __future__ import annotations

import pytest
import torch

from m27.train import precision
from m27.train.precision import SETTINGS, GradScaler, Plan, choose


@pytest.mark.parametrize(("capability", "prefer", "mode", "settings"), [
    ((6, 1), "auto", "fp32", None),  # Pascal: fp32 unless asked
    ((6, 1), "fp16", "fp16", SETTINGS["pascal"]),
    ((7, 0), "auto", "fp16", SETTINGS["volta"]),  # Volta
    ((7, 5), "auto", "fp16", SETTINGS["volta"]),  # Turing: Volta's settings
    ((7, 5), "bf16", "fp32", None),  # no bf16 before Ampere
    ((8, 0), "auto", "bf16", None),  # Ampere: bf16, no scaler
    ((8, 6), "fp16", "fp16", SETTINGS["ampere"]),
    ((9, 0), "auto", "bf16", None),  # Hopper
    ((9, 0), "fp16", "fp16", SETTINGS["ampere"]),
    (None, "auto", "fp32", None),  # CPU
    (None, "bf16", "bf16", None),
    ((8, 0), "fp32", "fp32", None),
])
def test_choose(capability: tuple[int, int] | None, prefer: precision.Prefer, mode: str,
                settings: precision.ScalerSettings | None) -> None:
    plan = choose(capability, prefer)
    assert (plan.mode, plan.scaler) == (mode, settings)
    assert plan.reason


def test_the_lab_settings_per_generation() -> None:
    assert [(s.init_scale, s.growth_interval, s.max_scale) for s in SETTINGS.values()] == [
        (8192, 2000, 32768), (16384, 1000, 65536), (32768, 500, 131072)]


def test_a_plan_names_its_dtype() -> None:
    assert Plan("bf16", "ampere", None, "").dtype is torch.bfloat16


def test_the_scale_never_grows_past_its_maximum_and_is_saved() -> None:
    scaler = GradScaler("cpu", init_scale=16.0, growth_interval=1, max_scale=64.0)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for _ in range(5):
        optimizer.zero_grad()
        scaler.scale(weight.sum()).backward()  # type: ignore[no-untyped-call]
        scaler.step(optimizer)
        scaler.update()
    assert scaler.get_scale() == 64.0
    state = scaler.state_dict()
    assert state["max_scale"] == 64.0
    other = GradScaler("cpu")
    other.load_state_dict(state)
    assert (other.get_scale(), other.max_scale) == (64.0, 64.0)


def test_on_a_machine_without_gpu_it_is_fp32_with_a_disabled_scaler() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    prec = precision.for_device()
    assert prec.plan.mode == "fp32"
    assert not prec.scaler.is_enabled()
    with prec.autocast():
        assert torch.ones(1).dtype is torch.float32
    bf16 = precision.for_device(prefer="bf16")
    with bf16.autocast():
        out = torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2))
    assert out.dtype is torch.bfloat16
