"""A minimal terminal for tests: replays what the CLI wrote (text, CR/LF and the cursor and
erase sequences rich uses) onto a grid, so a test sees what a person would see."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"\x1b\[(\??)([0-9;]*)([A-Za-z])|\r|\n|[^\x1b\r\n]")


def screen(written: str, width: int) -> list[str]:
    """The rows on screen after `written`, trailing blanks stripped; raises if a row ever
    got wider than `width` (it would have wrapped and pushed the frame down)."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for match in _CONTROL.finditer(written):
        text = match.group(0)
        if text == "\n":
            row, col = row + 1, 0
        elif text == "\r":
            col = 0
        elif text.startswith("\x1b["):
            private, arg, code = match.groups()
            count = int(arg) if arg.isdigit() else 1
            if private or code == "m":
                continue  # cursor visibility, colours
            if code == "A":
                row = max(0, row - count)
            elif code == "F":
                row, col = max(0, row - count), 0
            elif code == "K":
                rows[row] = rows[row][:col] if arg in ("", "0") else []
            elif code == "J":
                del rows[row + 1:]
                rows[row] = rows[row][:col]
            elif code == "H":
                row = col = 0
            else:
                raise AssertionError(f"unexpected control sequence {text!r}")
        else:
            if col >= width:
                raise AssertionError(f"row {row} is wider than {width} columns")
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = text
            else:
                line.append(text)
            col += 1
        while len(rows) <= row:
            rows.append([])
    shown = ["".join(r).rstrip() for r in rows]
    while shown and not shown[-1]:
        shown.pop()  # the row the cursor rests on below the frame
    return shown
