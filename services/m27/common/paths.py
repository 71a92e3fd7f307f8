"""Where m27 keeps its data on this machine: `$M27_HOME`, by default a per-user data dir."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def m27_home(environ: Mapping[str, str] | None = None) -> Path:
    """`$M27_HOME`, else `$XDG_DATA_HOME/m27`, else `~/.local/share/m27`.

    The only reader of these variables: a service takes its home from its loaded config
    (`LoadedConfig.home`, `ServiceRuntime.home`), the CLI resolves it once per command."""
    env = os.environ if environ is None else environ
    explicit = env.get("M27_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "m27"


def run_dir(home: Path, run_id: str) -> Path:
    """A run's own directory: scratch work dir and step logs live under it."""
    return home / "runs" / run_id
