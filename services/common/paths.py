"""Where m27 keeps its data on this machine: `$M27_HOME`, by default a per-user data dir."""

from __future__ import annotations

import os
from pathlib import Path


def m27_home() -> Path:
    """`$M27_HOME`, else `$XDG_DATA_HOME/m27`, else `~/.local/share/m27`."""
    explicit = os.environ.get("M27_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "m27"


def run_dir(home: Path, run_id: str) -> Path:
    """A run's own directory: scratch work dir and step logs live under it."""
    return home / "runs" / run_id
