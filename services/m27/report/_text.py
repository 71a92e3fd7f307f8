"""Text helpers of the renderer: every user-controlled string goes through `esc` or `esc_tail`.

Names, commands, log tails, reasons and paths come from users and from their programs' output,
so they are cleaned of control characters (and of bidi overrides, which can make a command
read differently from what ran) before being HTML-escaped.
"""

from __future__ import annotations

import html
import re
import time
from typing import Final

from m27.common.units import format_duration

NO_VALUE: Final = "—"
#: A log tail longer than this is cut at its start: the end is what explains a failure.
MAX_TAIL_CHARS: Final = 64 * 1024

# C0 controls except \t and \n, DEL, C1 controls, bidi embeddings/overrides/isolates, and lone
# surrogates (which cannot be written as UTF-8).
_UNSAFE_RE: Final = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
# Terminal escape sequences (colours, cursor moves, window titles) programs write to logs.
_ANSI_RE: Final = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves
    r"|\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: window titles, hyperlinks
    r"|[@-Z\\-_])"  # two-character escapes
)


def clean(text: str) -> str:
    """`text` without control characters other than newline and tab."""
    return _UNSAFE_RE.sub("", text)


def esc(text: str) -> str:
    """Cleaned and escaped for HTML text and (double- or single-quoted) attribute values."""
    return html.escape(clean(text), quote=True)


def clean_tail(text: str) -> str:
    """A log tail as a terminal would show it: no colour codes, `\\r` overwrites its line."""
    text = _ANSI_RE.sub("", text)
    lines = text.replace("\r\n", "\n").split("\n")
    text = "\n".join(line.rsplit("\r", 1)[-1] for line in lines)
    if len(text) > MAX_TAIL_CHARS:
        text = "… (earlier output cut)\n" + text[-MAX_TAIL_CHARS:]
    return clean(text)


def esc_tail(text: str) -> str:
    return html.escape(clean_tail(text), quote=True)


def fmt_time(ts: float | None) -> str:
    """UTC, ISO-like and readable: `2024-05-01 12:34:56 UTC`; `—` when there is none."""
    if ts is None:
        return NO_VALUE
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def iso_time(ts: float) -> str:
    """The machine form for a `<time datetime=…>` attribute."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def fmt_span(start: float | None, end: float | None) -> str:
    """How long from `start` to `end`, or `—` when either is missing."""
    if start is None or end is None:
        return NO_VALUE
    return fmt_seconds(max(0.0, end - start))


def fmt_seconds(seconds: float) -> str:
    """`format_duration`, except that nothing at all reads `0s` rather than `0ms`."""
    return "0s" if seconds == 0 else format_duration(seconds)


def shorten(text: str, limit: int) -> str:
    """At most `limit` characters, an ellipsis marking a cut."""
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "…"
