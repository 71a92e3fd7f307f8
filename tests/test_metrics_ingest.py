"""Training metrics from a real step to the bus (issue 15, point 1): `m27.train.log` and
lines a shell appends to `$M27_METRICS_FILE` both become `metric_points` on
`m27.metrics.<run>.<step>.node-<node>`, every point once and in order, with the attempt;
a retried attempt continues the same series, which the report service's history store
holds the same way. Every heartbeat's GPU readings reach M27_TELEMETRY, and the history
knows which GPU a step held and when (point 2)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.common.metric_points import series
from m27.report.service import history_path
from m27.report.store import History
from tests.support import Cluster, finished_run, report_of, stored

pytestmark = pytest.mark.integration

SCRIPT = """\
import os, sys
import m27.train
attempt = int(os.environ["M27_ATTEMPT"])
first = 0 if attempt == 1 else 3000  # the second attempt "resumed" at step 3000
for step in range(first, 5000 if attempt == 2 else 4000):
    m27.train.log(step, loss=1.0 / (step + 1), attempt=attempt)
m27.train.flush_metrics()
sys.exit(1 if attempt == 1 else 0)
"""


async def stream_of(bus: NatsBus, run_id: str) -> list[tuple[str, events.MetricPoints]]:
    batches = [(subject, events.decode_metrics(data))
               for subject, data in await stored(bus, subjects.METRICS_STREAM)]
    return [(subject, batch) for subject, batch in batches if batch.run_id == run_id]


async def test_logged_points_reach_the_bus_once_each_and_attempts_make_one_series(
        cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    pipeline = (
        "pipeline:\n"
        "  - name: train\n"
        f"    command: {sys.executable} {script}\n"
        "    retries: {failure: 1, backoff: {initial: 1s}}\n"
        "  - name: shell\n"
        "    command: |\n"
        "      echo '{\"step\": 1, \"acc\": 0.5}' >> \"$M27_METRICS_FILE\"\n"
        "      echo 'not a metric' >> \"$M27_METRICS_FILE\"\n"
        "      printf '{\"step\": 2, \"acc\": NaN}\\n' >> \"$M27_METRICS_FILE\"\n")
    async with cluster.client() as client:
        run_id = await client.submit(pipeline, workdir=str(tmp_path))
        run = await finished_run(client, run_id, timeout=120)
    assert run.state == "succeeded", run
    bus = await NatsBus.open(cluster.nats_url, name="test-metrics")
    try:
        found = await stream_of(bus, run_id)
    finally:
        await bus.close()
    train = run.step("train")
    assert train is not None
    assert train.node_id
    node = train.node_id
    assert {s for s, _ in found} == {subjects.metrics(run_id, name, f"node-{node}")
                                     for name in ("train", "shell")}
    by_attempt: dict[int, list[events.MetricPoint]] = {}
    for _, batch in found:
        if batch.step == "train":
            by_attempt.setdefault(batch.attempt, []).extend(batch.points)
    assert sorted(by_attempt) == [1, 2]
    assert [p.step for p in by_attempt[1]] == list(range(4000))  # all, once, in order
    assert [p.step for p in by_attempt[2]] == list(range(3000, 5000))
    merged = series(by_attempt)
    assert [p.step for p in merged] == list(range(5000))
    assert {p.values["attempt"] for p in merged[3000:]} == {2.0}
    shell = [p for _, b in found if b.step == "shell" for p in b.points]
    assert [(p.step, p.values) for p in shell] == [(1, {"acc": 0.5}), (2, {"acc": "NaN"})]
    # the report service materialises the same series into its history store
    history = History(history_path(cluster.home))
    try:
        deadline = time.monotonic() + 60
        while len(stored := history.metric_series(run_id, "train", "loss")) < 5000:
            assert time.monotonic() < deadline, len(stored)
            await asyncio.sleep(0.2)
        assert [p.step for p in stored] == list(range(5000))
        assert [p.step for p in history.metric_series(run_id, "train", "attempt")
                if p.values["attempt"] == 2.0] == list(range(3000, 5000))
        assert history.metric_names(run_id, "shell") == ["acc"]
    finally:
        history.close()


async def test_the_history_knows_which_gpu_a_step_held_from_the_telemetry_stream(
        cluster: Cluster, tmp_path: Path) -> None:
    release = tmp_path / "release"
    pipeline = (
        "pipeline:\n"
        "  - name: md\n"
        "    type: gpu\n"
        f"    command: for i in $(seq 600); do test -f {release} && exit 0; sleep 0.1; done;"
        " exit 1\n")
    history = History(history_path(cluster.home))
    try:
        async with cluster.client() as client:
            run_id = await client.submit(pipeline, workdir=str(tmp_path))
            deadline = time.monotonic() + 60
            while not (held := history.held_gpus(f"{run_id}/md")):  # seen while it runs
                assert time.monotonic() < deadline, cluster.logs()
                await asyncio.sleep(0.2)
            release.touch()
            run = await finished_run(client, run_id, timeout=60)
            report = await report_of(client, run_id)
        assert run.state == "succeeded", run
        assert "<h3>GPUs held</h3>" in report  # its GPU's readings over its span
        assert "GPU utilisation (%)" in report
        md = run.step("md")
        assert md is not None
        assert md.node_id
        [span] = held
        assert (span.attempt, span.node_id, (span.gpu,), span.share) == (
            md.attempt, md.node_id, md.gpu_ids, 1.0)
        assert span.first_at <= span.last_at
        assert f"{run_id}/md" in [h.task_id for h in
                                  history.holders(md.node_id, span.gpu, span.first_at)]
        readings = history.gpu_history(span.first_at - 1, span.last_at + 1, max_points=1000)
        assert readings[(md.node_id, span.gpu)], readings
    finally:
        history.close()
    bus = await NatsBus.open(cluster.nats_url, name="test-telemetry")
    try:
        info = await bus.js.stream_info(subjects.TELEMETRY_STREAM)
        last = await bus.js.get_last_msg(subjects.TELEMETRY_STREAM,
                                         subjects.telemetry(f"node-{md.node_id}"))
    finally:
        await bus.close()
    assert info.state.messages > 0
    reading = events.decode_telemetry(last.data or b"")
    assert (reading.node_id, reading.backend) == (md.node_id, "simulated")
    assert [g.index for g in reading.gpus] == [0, 1]
    assert all(g.simulated for g in reading.gpus)
