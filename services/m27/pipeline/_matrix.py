"""Sweeps (pure): a `matrix:` step becomes one step per combination of its axes' values."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from typing import Final

from m27.common.ids import is_valid_name

_UNSAFE: Final = re.compile(r"[^A-Za-z0-9-]+")
MAX_NAME: Final = 100

Axes = Sequence[tuple[str, Sequence[str]]]


def size(axes: Axes) -> int:
    """How many combinations `combinations` would make, without making them."""
    return math.prod(len(values) for _, values in axes)


def combinations(axes: Axes) -> list[dict[str, str]]:
    """Every combination, the last axis varying fastest (as nested loops would)."""
    keys = [key for key, _ in axes]
    return [dict(zip(keys, values, strict=True))
            for values in itertools.product(*(values for _, values in axes))]


def member_name(base: str, values: dict[str, str]) -> str:
    """`train` with lr=1e-3, seed=1 → `train-lr1e-3-seed1` (one subject token)."""
    parts = [base] + [f"{key}{_UNSAFE.sub('_', value).strip('_')}"
                      for key, value in values.items()]
    return "-".join(parts)


def member_names(base: str, combos: Sequence[dict[str, str]]) -> list[str]:
    """Readable names from the values; numbered (`train-0`, …) when those would collide or
    not be valid names, so every member always has a unique, valid name."""
    names = [member_name(base, combo) for combo in combos]
    if len(set(names)) == len(names) and all(is_valid_name(n) for n in names):
        return names
    width = len(str(len(combos) - 1))
    prefix = base[:MAX_NAME - width - 1]
    return [f"{prefix}-{i:0{width}d}" for i in range(len(combos))]
