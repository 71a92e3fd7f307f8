"""Filling `{{NAME}}` placeholders in shell commands so a value is only ever data (pure).

A value is inserted as literal text, quoted for the shell context the placeholder sits in:
- outside quotes it becomes one single-quoted word (`x; rm -rf /` → `'x; rm -rf /'`);
- inside double quotes its backslashes, double quotes, `$` and backquotes are escaped;
- inside single quotes each `'` is closed, escaped and reopened;
- inside backquotes the single-quoted word is escaped once more.
Either way the program receives exactly the characters of the value, and nothing in it can
run as a command.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from typing import Final, Literal

Context = Literal["plain", "single", "double", "backtick"]
_DOUBLE_SPECIAL: Final = re.compile(r'([\\"$`])')
_BACKTICK_SPECIAL: Final = re.compile(r"([\\`$])")


def quote(value: str, context: Context) -> str:
    """`value` as literal text for the given quoting context."""
    if context == "single":
        return value.replace("'", "'\\''")
    if context == "double":
        return _DOUBLE_SPECIAL.sub(r"\\\1", value)
    if context == "backtick":  # the backquote layer removes one level of backslashes first
        return _BACKTICK_SPECIAL.sub(r"\\\1", shlex.quote(value))
    return shlex.quote(value)


def quote_all(values: Sequence[str], context: Context) -> str:
    """Several values (a step's outputs): one word each outside quotes, else one text."""
    if context in ("plain", "backtick"):
        return " ".join(quote(v, context) for v in values)
    return quote(" ".join(values), context)


def substitute(template: str, placeholder: re.Pattern[str],
               value_for: Callable[[re.Match[str]], str | Sequence[str] | None]) -> str:
    """Replace each placeholder match by its value(s), quoted for its context.

    `value_for` returns None to leave a placeholder as written (it reports the problem)."""
    out: list[str] = []
    stack: list[Context] = ["plain"]
    i = 0
    while i < len(template):
        match = placeholder.match(template, i)
        if match:
            value = value_for(match)
            if value is None:
                out.append(match.group(0))
            elif isinstance(value, str):
                out.append(quote(value, stack[-1]))
            else:
                out.append(quote_all(value, stack[-1]))
            i = match.end()
            continue
        step = _advance(template, i, stack)
        out.append(template[i:i + step])
        i += step
    return "".join(out)


def _advance(text: str, i: int, stack: list[Context]) -> int:
    """Update the quoting stack for the characters at `i`; return how many were consumed."""
    char, top = text[i], stack[-1]
    if top == "single":
        if char == "'":
            stack.pop()
        return 1
    if char == "\\":
        return 2
    if text.startswith("$(", i):
        stack.append("plain")
        return 2
    if top == "double":
        if char == '"':
            stack.pop()
        elif char == "`":
            stack.append("backtick")
        return 1
    if char == "'":
        stack.append("single")
    elif char == '"':
        stack.append("double")
    elif char == "`":
        if top == "backtick":
            stack.pop()
        else:
            stack.append("backtick")
    elif char == "(":
        stack.append("plain")
    elif char == ")" and len(stack) > 1:
        stack.pop()
    return 1
