"""Hints for error messages: the known name a mistyped one most likely meant."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def did_you_mean(value: str, choices: Sequence[str]) -> str:
    """"did you mean `epochs`?" for "epoch" among the choices; "" when none is close."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else ""


def one_of(value: str, choices: Sequence[str], what: str = "known", shown: int = 20) -> str:
    """The close match if there is one, else the choices themselves (at most `shown`):
    "did you mean `train`?" or "its steps: prepare, train, analyze"."""
    hint = did_you_mean(value, choices)
    if hint or not choices:
        return hint
    listed = ", ".join(choices[:shown])
    more = f" and {len(choices) - shown} more" if len(choices) > shown else ""
    return f"{what}: {listed}{more}"
