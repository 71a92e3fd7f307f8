"""A step's training monitor as users run it (issue 15, point 3): a pipeline with
`monitor:` on a real system; a loss spike in what the step logs becomes `training_anomaly`
on its task subject, and the last checkpoint from before the spike is protected: later
uploads retire the ones around it, it stays, marked with why."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from m27.checkpoint_store import KvManifestIndex
from m27.common import events, subjects
from m27.common.bus import NatsBus
from tests.support import Cluster, finished_run, report_of, stored

pytestmark = pytest.mark.integration

#: Its files change every 0.1 s and are uploaded every second (`checkpoint: 1s`); the
#: spike comes after about 3 s, then it goes on for 8 s more: more uploads than the store
#: keeps (the last 3).
SPIKE_AFTER_UPLOADS = """\
import json, os, pathlib, sys, time
state = pathlib.Path(os.environ["M27_CHECKPOINT_DIR"]) / "state.txt"
metrics = open(os.environ["M27_METRICS_FILE"], "a")
def tick(step, loss, t=None):
    state.write_text(f"after step {step}")
    t = time.time() if t is None else t  # when it was logged, as m27.train.log stamps it
    metrics.write(json.dumps({"step": step, "t": t, "loss": loss}) + "\\n")
    metrics.flush()
    time.sleep(0.1)
for step in range(30):
    tick(step, 1.0 + 0.01 * (step % 3))
spiked_at = time.time()
tick(30, 40.0, spiked_at)
for step in range(31, 110):
    tick(step, 1.0)
pathlib.Path(sys.argv[1]).write_text(repr(spiked_at))
"""


async def anomalies_of(bus: NatsBus, run_id: str) -> list[events.TrainingAnomaly]:
    found = [events.decode_event(data)
             for _, data in await stored(bus, subjects.EVENTS_STREAM)]
    return [e for e in found if isinstance(e, events.TrainingAnomaly) and e.run_id == run_id]


async def test_a_spike_protects_the_last_checkpoint_from_before_it(
        cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SPIKE_AFTER_UPLOADS)
    spiked = tmp_path / "spiked_at"
    pipeline = (
        "pipeline:\n"
        "  - name: train\n"
        f"    command: {sys.executable} {script} {spiked}\n"
        "    checkpoint: 1s\n"
        "    checkpoint_signal: none\n"
        "    monitor: {metric: loss, divergence: 0}\n")
    async with cluster.client() as client:
        run_id = await client.submit(pipeline, workdir=str(tmp_path))
        run = await finished_run(client, run_id, timeout=120)
        report = await report_of(client, run_id)
    assert run.state == "succeeded", cluster.logs()
    spiked_at = float(spiked.read_text())
    # the run report shows the curve's results, the anomaly and the checkpoints
    assert "<h2>Results</h2>" in report
    assert '<td>loss</td><td class="num">1</td><td class="num">109</td>' in report
    assert report.count('class="mark anomaly"') == 1
    assert "<title>spike in loss at training step 30</title>" in report
    assert report.count('class="mark checkpoint"') >= 3
    assert "<h3>Training anomalies</h3>" in report
    assert "loss by training step (110 points)" in report
    bus = await NatsBus.open(cluster.nats_url, name="test-anomaly")
    try:
        found = await anomalies_of(bus, run_id)
        manifests = await KvManifestIndex(bus).list(f"{run_id}.train.*")  # its keys
    finally:
        await bus.close()
    assert [(a.kind, a.metric, a.train_step, a.value) for a in found] == [
        ("spike", "loss", 30, 40.0)]
    protected = [m for m in manifests if m.protected]
    assert len(protected) == 1, [(m.seq, m.protected) for m in manifests]
    kept = protected[0]
    assert kept.protected.startswith("training anomaly: loss 40 at step 30")
    assert kept.created_at < spiked_at  # from before the spike was logged
    newer = [m for m in manifests if m.seq > kept.seq]
    assert newer, "no upload after the spike"
    # retention (the last 3) went on around it: it is kept for its protection alone
    assert kept.seq < max(m.seq for m in manifests) - 3
    assert sorted(m.seq for m in manifests) == [kept.seq, *sorted(m.seq for m in newer)[-3:]]
