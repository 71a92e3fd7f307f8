"""A finished run's checkpoints go `[checkpoint] keep_finished` after the run ended, on a
real `m27 up` (its NATS users with the permissions they are deployed with): the
checkpoint-store reads when the run ended from the runs bucket, removes the manifests and
then the chunks only they used. A run still going keeps its checkpoints."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import msgspec
import pytest

from m27.client import Client
from m27.client.checkpoints import RemoteStore
from m27.common.model import RunEnd, RunRecord, StoredRunEnd
from m27.embedded import system
from m27.orchestrator.runs import StoredRun
from tests.support import embedded, finished_run

pytestmark = pytest.mark.integration

STEP = """\
import os, sys, time
from m27.client.checkpoints import RemoteStore
store = RemoteStore(os.environ['M27_CHECKPOINT_STORE'])
store.put_bytes(store.task_id, os.urandom(4096), attempt=store.attempt)
print('committed', len(store.list(store.task_id)), flush=True)
if sys.argv[1] == 'wait':
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
"""


def pipeline(step: Path, *args: str) -> str:
    return ("pipeline:\n  - name: train\n    type: gpu_light\n"
            f"    command: {sys.executable} {step} {' '.join(args)}\n")


def chunk_files(home: Path) -> set[str]:
    return {p.name for p in (home / "checkpoints" / "chunks").glob("*/*")
            if not p.name.startswith(".")}


def gc_rounds(log_path: str) -> int:
    return Path(log_path).read_text(errors="replace").count("checkpoint.gc_done")


async def test_a_finished_runs_checkpoints_go_keep_finished_after_it_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("M27_CHECKPOINT_KEEP_FINISHED", "2s")
    monkeypatch.setenv("M27_CHECKPOINT_GC_INTERVAL", "300ms")
    monkeypatch.setenv("M27_CHECKPOINT_GC_GRACE", "1s")
    with embedded(tmp_path, tls=False) as home:
        state = system.read_state(home)
        assert state is not None
        (store_proc,) = [p for p in state.processes if p.name == "checkpoint-store"]
        step, release = home / "step.py", home / "release"
        step.write_text(STEP)
        async with Client(state.api) as client:
            going = await client.submit(pipeline(step, "wait", str(release)),
                                        workdir=str(home))
            done = await client.submit(pipeline(step, "end"), workdir=str(home))
            run = await finished_run(client, done)
            assert run.state == "succeeded", run
            out = home / "runs" / done / "logs" / "train.1.out"
            assert out.read_text() == "committed 1\n"  # it had a checkpoint
            with RemoteStore(store_proc.grpc_address) as store:
                deadline = time.monotonic() + 60
                while store.summaries(run_id=done):
                    assert time.monotonic() < deadline, "the finished run's checkpoint stayed"
                    await asyncio.sleep(0.1)
                while not (home / "runs" / going / "logs" / "train.1.out").exists() or \
                        not store.summaries(run_id=going):
                    assert time.monotonic() < deadline, "the running step never checkpointed"
                    await asyncio.sleep(0.1)
                kept = chunk_files(home)
                # every chunk left is the running step's: the finished run's went too
                while len(kept := chunk_files(home)) != 1:
                    assert time.monotonic() < deadline, kept
                    await asyncio.sleep(0.1)
                rounds = gc_rounds(store_proc.log_path)
                while gc_rounds(store_proc.log_path) < rounds + 3:  # the running one stays
                    assert time.monotonic() < deadline, "no GC rounds"
                    await asyncio.sleep(0.1)
                assert len(store.summaries(run_id=going)) == 1
                # read from the orchestrator's record over the real bus: not ended
                assert [s.removed_at for s in store.summaries(
                    run_id=going, with_removal=True)] == [None]
                assert chunk_files(home) == kept
            release.touch()
            assert (await finished_run(client, going)).state == "succeeded"


def test_the_store_reads_when_a_run_ended_from_the_record_the_orchestrator_stores() -> None:
    """The checkpoint-store decodes only `StoredRunEnd` of what the orchestrator writes
    (`StoredRun`): a renamed field must fail here, not silently keep checkpoints for ever."""
    record = RunRecord(run_id="r-20240101-120000-abc123", name="n", user="u",
                       urgency="normal", state="failed", created_at=1.0, steps=(),
                       ended_at=99.5)
    stored = msgspec.json.encode(StoredRun(run=record))
    assert msgspec.json.decode(stored, type=StoredRunEnd).run == RunEnd(state="failed",
                                                                        ended_at=99.5)
