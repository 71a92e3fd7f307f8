"""State dicts as a JSON skeleton plus a list of tensors (pure: no I/O, no threads).

`encode` walks a nested value (dicts, lists, tuples, scalars, tensors, numpy arrays,
bytes) and returns a JSON-able skeleton in which every tensor is replaced by
`{"__tensor": i}`; the caller decides what happens to tensor i (copied now, copied in the
background, stored as its own entry). `decode` rebuilds the value from the skeleton and
the restored tensors. Types survive the round trip exactly (tuples stay tuples, int keys
stay ints, NaN and ±inf floats stay floats), so `optimizer.load_state_dict` and friends
get back what they gave. No pickle: a checkpoint can never run code when it is read.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import torch

Json = Any  # None | bool | int | float | str | list[Json] | dict[str, Json]
OnTensor = Callable[[torch.Tensor, str], int]

_TAGS: Final = ("__tensor", "__tuple", "__dict", "__float", "__int", "__bytes", "__ndarray")
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` → "float32" (what an `Entry.dtype` holds)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return found


def encode(value: Any, on_tensor: OnTensor, path: str = "") -> Json:
    """The skeleton of `value`; `on_tensor(t, path)` registers each tensor and returns its
    index. Raises TypeError naming the path of anything that cannot be stored."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _INT_MAX else {"__int": str(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float": repr(value)}
    if isinstance(value, torch.Tensor):
        return {"__tensor": on_tensor(value, path)}
    if isinstance(value, tuple | list):
        if _plain_ints(value):  # e.g. Python's RNG state: 625 ints, kept fast
            items = list(value)
        else:
            items = [encode(v, on_tensor, f"{path}/{i}") for i, v in enumerate(value)]
        return {"__tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return _encode_dict(value, on_tensor, path)
    if isinstance(value, bytes | bytearray):
        return {"__bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, np.ndarray | np.generic):
        return {"__ndarray": _encode_array(np.asarray(value), path),
                "scalar": isinstance(value, np.generic)}
    raise TypeError(f"cannot checkpoint {path or 'the value'}: a {type(value).__name__} "
                    "(store tensors, numbers, strings, lists, dicts, numpy arrays or bytes)")


def _plain_ints(values: tuple[Any, ...] | list[Any]) -> bool:
    return len(values) > 8 and all(type(v) is int for v in values) and \
        min(values) >= _INT_MIN and max(values) <= _INT_MAX


def _encode_dict(value: dict[Any, Any], on_tensor: OnTensor, path: str) -> Json:
    if all(isinstance(k, str) and not k.startswith("__") for k in value):
        return {k: encode(v, on_tensor, f"{path}/{k}") for k, v in value.items()}
    pairs = [[encode(k, on_tensor, f"{path}/<key>"), encode(v, on_tensor, f"{path}/{k}")]
             for k, v in value.items()]
    return {"__dict": pairs}


def _encode_array(array: np.ndarray, path: str) -> Json:
    if array.dtype.hasobject:
        raise TypeError(f"cannot checkpoint {path}: a numpy array of Python objects")
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()}


def decode(skeleton: Json, tensors: list[torch.Tensor]) -> Any:
    """The value `encode` was given, with tensor i taken from `tensors[i]`."""
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    tag = next((t for t in _TAGS if t in skeleton), None)
    if tag is None:
        return {k: decode(v, tensors) for k, v in skeleton.items()}
    return _decode_tagged(tag, skeleton, tensors)


def _decode_tagged(tag: str, skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    body = skeleton[tag]
    if tag == "__tensor":
        return tensors[body]
    if tag == "__tuple":
        return tuple(decode(v, tensors) for v in body)
    if tag == "__dict":
        return {decode(k, tensors): decode(v, tensors) for k, v in body}
    if tag == "__float":
        return float(body)
    if tag == "__int":
        return int(body)
    if tag == "__bytes":
        return base64.b64decode(body)
    array = np.frombuffer(base64.b64decode(body["data"]), dtype=np.dtype(body["dtype"]))
    array = array.reshape(body["shape"]).copy()
    return array[()] if skeleton.get("scalar") else array
