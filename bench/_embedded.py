"""What several benchmarks share: the embedded system (`m27 up`) in a temporary home."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from m27.embedded import system
from m27.embedded.system import EmbeddedState


@contextlib.contextmanager
def temporary_system() -> Iterator[tuple[EmbeddedState, Path, Path]]:
    """`m27 up` (no GPUs) in a fresh home with no config file; (its state, the home, an
    empty working directory for the steps). Brought down and deleted at the end."""
    with tempfile.TemporaryDirectory(prefix="m27-bench-") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        work.mkdir()
        os.environ["M27_HOME"] = str(home)
        os.environ["M27_CONFIG"] = str(Path(tmp) / "none")
        try:
            state, _ = system.up(home, gpus="none", log_level="warning")
            yield state, home, work
        finally:
            system.down(home)
