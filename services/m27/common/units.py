"""Durations (`300s`, `5m`, `50ms`) and sizes (`128KB`, `8GiB`) as users write them."""

from __future__ import annotations

import math
import re

# ASCII digits only: `\d` would take any Unicode digit.
_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*", re.IGNORECASE)
_DURATION_FACTORS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGTP])(i)?)?(B)?\s*", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_duration(text: str | int | float) -> float:
    """Seconds in `text`: a bare number means seconds; units ms, s, m, h, d.

    Raises ValueError with a message that shows what is accepted.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a duration such as 300s, 5m or 1h, got {text!r}")
    if isinstance(text, int | float):
        try:
            value = float(text)
        except OverflowError:  # an int past float's range (10**400)
            raise ValueError(f"expected a duration such as 300s, 5m or 1h, got a number of "
                             f"{len(str(abs(text)))} digits") from None
    else:
        match = _DURATION_RE.fullmatch(text)
        if not match:
            raise ValueError(f"expected a duration such as 300s, 5m or 1h, got {text!r}")
        unit = (match.group(2) or "s").lower()
        value = float(match.group(1)) * _DURATION_FACTORS[unit]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"expected a non-negative duration, got {text!r}")
    return value


def parse_size(text: str | int) -> int:
    """Bytes in `text`: KB/MB/GB are powers of 1024 as in the lab's config (128KB = 131072),
    KiB/MiB/GiB likewise; a bare number means bytes."""
    if isinstance(text, bool):
        raise ValueError(f"expected a size such as 128KB or 8GiB, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"expected a non-negative size, got {text!r}")
        return text
    match = _SIZE_RE.fullmatch(text)
    if not match or (match.group(3) and not match.group(2)):
        raise ValueError(f"expected a size such as 128KB or 8GiB, got {text!r}")
    power = _SIZE_POWERS[(match.group(2) or "").upper()]
    return int(float(match.group(1)) * 1024 ** power)


def format_duration(seconds: float) -> str:
    """A short human form: 850ms, 42s, 3m05s, 2h10m."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_size(num_bytes: int) -> str:
    """A short human form in powers of 1024: 512B, 12.0KiB, 3.4GiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")
