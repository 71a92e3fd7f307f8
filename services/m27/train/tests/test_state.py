"""State skeletons: every value a state dict holds survives the round trip, type and all."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from m27.train import _state


def round_trip(value: Any) -> Any:
    tensors: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor, path: str) -> int:
        tensors.append(tensor)
        return len(tensors) - 1

    skeleton = msgspec.json.decode(msgspec.json.encode(_state.encode(value, keep)))
    return _state.decode(skeleton, tensors)


def test_tuples_int_keys_and_non_finite_floats_come_back_as_they_were() -> None:
    value: dict[str, Any] = {
        "state": {0: {"step": 3}, 7: {}}, "betas": (0.9, 0.999), "best": math.inf,
        "worst": -math.inf, "big": 2**70, "neg": -(2**70), "raw": b"\x00\xff",
        "__dunder": 1, "flags": [True, None, "x"]}
    back = round_trip(value)
    assert back == value
    assert isinstance(back["betas"], tuple)
    assert list(back["state"]) == [0, 7]
    assert math.isnan(round_trip(math.nan))


def test_numpy_arrays_and_scalars_and_rng_states_round_trip() -> None:
    state: Any = np.random.get_state()
    back = round_trip({"np": state, "scalar": np.int64(5), "arr": np.arange(6).reshape(2, 3)})
    assert back["np"][0] == state[0]
    assert np.array_equal(back["np"][1], state[1])
    assert back["np"][1].dtype == state[1].dtype
    assert back["scalar"] == 5
    assert isinstance(back["scalar"], np.int64)
    assert back["arr"].shape == (2, 3)


def test_tensors_are_handed_to_the_callback_and_put_back_in_place() -> None:
    weight = torch.randn(3)
    back = round_trip({"layer": {"weight": weight, "sizes": (1, 2)}})
    assert back["layer"]["weight"] is weight


def test_something_that_cannot_be_stored_is_refused_with_its_path() -> None:
    with pytest.raises(TypeError, match="extras/fn"):
        _state.encode({"fn": print}, lambda t, p: 0, "extras")


def test_dtype_names_round_trip() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                  torch.uint8, torch.complex64):
        assert _state.dtype_from_name(_state.dtype_name(dtype)) is dtype
    with pytest.raises(ValueError, match="not a torch dtype"):
        _state.dtype_from_name("Tensor")


leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
trees = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=4)
    | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=5) | st.integers(), children, max_size=4),
    max_leaves=20)


@given(trees)
def test_any_tree_of_plain_values_round_trips(value: Any) -> None:
    assert round_trip(value) == value
