"""Service logs under the real launcher: every line JSON, rotated by size."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Cluster

pytestmark = pytest.mark.integration


@pytest.fixture
def small_logs(tmp_path: Path) -> Iterator[Cluster]:
    system = Cluster(tmp_path, env={"M27_LOG_MAX_BYTES": "1024", "M27_LOG_KEEP": "2"})
    system.start()
    yield system
    system.stop()


def test_service_logs_rotate_by_size_and_every_line_is_json(small_logs: Cluster) -> None:
    logs = small_logs.root / "logs"
    small_logs.stop()  # the stop lines are logged too
    rotated = sorted(p.name for p in logs.glob("*.log.*"))
    assert rotated, sorted(p.name for p in logs.iterdir())  # startup alone is over 1 KiB
    for name in small_logs.processes:
        files = sorted(logs.glob(f"{name}.log*"))
        assert len(files) <= 3, files  # the live file and at most two older ones
        for path in files:
            for line in path.read_text().splitlines():
                assert json.loads(line)["service"], (path.name, line)
