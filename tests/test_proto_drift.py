"""The committed gRPC stubs are exactly what `task proto` generates from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_match_the_proto_files(tmp_path: Path) -> None:
    out = tmp_path / "v1"
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(out)],
                   check=True, capture_output=True)
    committed = ROOT / "services" / "m27" / "v1"
    generated = {p.name: p.read_bytes() for p in out.iterdir()}
    existing = {p.name: p.read_bytes() for p in committed.iterdir() if p.is_file()}
    assert sorted(generated) == sorted(existing), "stub files differ: run `task proto`"
    stale = [name for name, data in generated.items() if existing[name] != data]
    assert not stale, f"stale generated stubs {stale}: run `task proto` and commit"
