"""`m27 compare` on a real system (issue 15, point 5): a `matrix:` sweep whose members log
with `m27.train.log` is compared from the report service's history — the varied values
against final and best loss, as CSV, JSON and an HTML page, with the figures as SVG and
PDF — and the metrics API keeps a run's curves to its owner."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from m27.client.report import ReportClient, ReportError, RunUnknown
from m27.common.curves import Curve
from tests.support import Cluster, finished_run

pytestmark = pytest.mark.integration

SCRIPT = """\
import sys
import m27.train
lr, seed = float(sys.argv[1]), int(sys.argv[2])
for step in range(200):
    m27.train.log(step, loss=lr * seed + 1.0 / (step + 1), acc=1.0 - lr * seed)
m27.train.flush_metrics()
"""


async def curves_of(report: ReportClient, run_id: str, count: int) -> list[Curve]:
    """The run's curves once `count` of them hold all 200 points (the report service
    materialises the stream as it arrives)."""
    deadline = time.monotonic() + 60
    while True:
        curves = await report.metrics(run_id, names=["loss"])
        if len(curves) == count and all(c.count == 200 for c in curves):
            return curves
        assert time.monotonic() < deadline, curves
        await asyncio.sleep(0.2)


def m27(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "M27_TOKEN": str(cluster.access.token)}
    env.pop("M27_API", None)
    return subprocess.run(
        [sys.executable, "-m", "m27.cli", "--api", cluster.api, "compare", *args,
         "--report", cluster.processes["report"].grpc_address],
        env=env, capture_output=True, text=True, timeout=120)


async def test_a_sweep_is_compared_as_a_table_csv_json_html_and_figures(
        cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    pipeline = (
        "pipeline:\n"
        "  - name: train\n"
        "    matrix: {lr: [0.1, 0.01], seed: [1, 2]}\n"
        f"    command: {sys.executable} {script} {{{{matrix.lr}}}} {{{{matrix.seed}}}}\n")
    report_address = cluster.processes["report"].grpc_address
    async with cluster.client() as client:
        run_id = await client.submit(pipeline, workdir=str(tmp_path))
        run = await finished_run(client, run_id, timeout=120)
        assert run.state == "succeeded", run
        async with ReportClient(report_address, access=cluster.access) as report:
            curves = await curves_of(report, run_id, 4)
            thinned = await report.metrics(run_id, names=["loss"], max_points=20)
    assert all(len(c.steps) <= 20 and c.count == 200 for c in thinned)
    assert {c.min for c in thinned} == {c.min for c in curves}  # summaries use every point
    out = tmp_path / "cmp"
    done = await asyncio.to_thread(m27, cluster, run_id, "--format", "csv", "-o", str(out))
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert [(r["lr"], r["seed"]) for r in rows] == [  # best (lowest) loss first
        ("0.01", "1"), ("0.01", "2"), ("0.1", "1"), ("0.1", "2")]
    assert float(rows[0]["loss_best"]) == pytest.approx(0.01 + 1 / 200)
    assert rows[0]["loss_best_step"] == "199"
    assert float(rows[3]["acc_final"]) == pytest.approx(0.8)
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted([
        "compare.csv", "compare.json", "compare.html",
        *(f"{kind}.{ext}" for kind in ("curves-loss", "curves-acc", "parallel-loss",
                                       "heatmap-loss") for ext in ("svg", "pdf"))])
    assert (out / "curves-loss.pdf").read_bytes().startswith(b"%PDF")
    html = (out / "compare.html").read_text()
    assert html.count("<svg") == 4
    assert "train-lr0_01-seed1" in html
    data = json.loads((await asyncio.to_thread(m27, cluster, run_id, "--format", "json",
                                               "--metric", "acc")).stdout)
    assert data["goals"] == {"acc": "max"}
    assert data["rows"][0]["params"] == {"lr": "0.01", "seed": "1"}  # the highest acc
    again = await asyncio.to_thread(m27, cluster, run_id, "-o", str(tmp_path / "cmp2"))
    assert again.returncode == 0, again.stderr
    for name in ("curves-loss.svg", "curves-loss.pdf", "heatmap-loss.pdf"):
        assert (out / name).read_bytes() == (tmp_path / "cmp2" / name).read_bytes(), name


async def test_the_metrics_api_keeps_a_runs_curves_to_its_owner(
        cluster: Cluster, tmp_path: Path) -> None:
    async with cluster.client() as client:
        run_id = await client.submit("pipeline:\n  - {name: a, command: 'true'}\n",
                                     workdir=str(tmp_path))
        await finished_run(client, run_id, timeout=60)
    address = cluster.processes["report"].grpc_address
    async with ReportClient(address, access=cluster.access_as("mallory")) as other:
        with pytest.raises(ReportError, match="belongs to another user"):
            await other.metrics(run_id)
        with pytest.raises(RunUnknown, match="no run r-20000101-000000-000000"):
            await other.metrics("r-20000101-000000-000000")
        with pytest.raises(ReportError, match="not a run id"):
            await other.metrics("../../etc/passwd")
    async with ReportClient(address, access=cluster.access) as admin:
        assert await admin.metrics(run_id) == []  # known, nothing logged
    channel = cluster.bare_channel(address)
    try:
        from m27.v1 import report_pb2, report_pb2_grpc
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await report_pb2_grpc.ReportServiceStub(channel).GetMetrics(
                report_pb2.GetMetricsRequest(run_id=run_id), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await channel.close(None)
    nothing = await asyncio.to_thread(m27, cluster, run_id)
    assert nothing.returncode == 1
    assert nothing.stderr.startswith(f"m27: nothing to compare: {run_id}: no metrics logged")
    bad = await asyncio.to_thread(m27, cluster, "nope")
    assert (bad.returncode, "Traceback" in bad.stderr) == (1, False)
    assert "not a run id: 'nope'" in bad.stderr
