"""The pipeline language at work on the real system: retries, timeouts, outputs, sweeps,
reuse of earlier results, retry and cancel of one step, history, resumable watches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from m27.client import Client, ClientError, PipelineRejected, RunEvent
from m27.common.model import RunRecord
from tests.support import Cluster, finished_run

pytestmark = pytest.mark.integration


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Client]:
    async with cluster.client() as connected:
        yield connected


def step(run: RunRecord, name: str) -> object:
    found = run.step(name)
    assert found is not None, name
    return found


async def test_a_failing_step_is_retried_after_its_backoff_and_then_succeeds(
        client: Client, tmp_path: Path) -> None:
    text = """pipeline:
  - name: flaky
    command: "echo x >> tries; test $(wc -l < tries) -ge 2"
    retries: {failure: 2, backoff: {initial: 1s}}
  - {name: after, command: "true", depends_on: [flaky]}
"""
    run = await finished_run(client, await client.submit(text, workdir=str(tmp_path)))
    assert run.state == "succeeded"
    flaky = run.step("flaky")
    assert flaky is not None
    assert (flaky.attempt, flaky.failures) == (2, 1)
    assert [a.attempt for a in flaky.history] == [1, 2]
    assert flaky.history[0].exit_code == 1
    restarted, failed = flaky.history[1].started_at, flaky.history[0].ended_at
    assert restarted is not None
    assert failed is not None
    assert restarted - failed >= 0.9
    assert (tmp_path / "tries").read_text() == "x\nx\n"


async def test_timeouts_and_missing_outputs_fail_the_step(client: Client,
                                                          tmp_path: Path) -> None:
    text = """pipeline:
  - {name: slow, command: "sleep 60", timeout: 1s}
  - {name: lazy, command: "true", outputs: [result.csv]}
"""
    began = time.monotonic()
    run = await finished_run(client, await client.submit(text, workdir=str(tmp_path)))
    assert time.monotonic() - began < 30
    slow, lazy = run.step("slow"), run.step("lazy")
    assert slow is not None
    assert lazy is not None
    assert slow.state == "failed"
    assert "timed out after 1s" in slow.reason
    assert lazy.state == "failed"
    assert lazy.reason == "declared output(s) missing: result.csv"


async def test_a_sweep_runs_within_its_cap_and_feeds_its_outputs_on(
        client: Client, tmp_path: Path) -> None:
    text = """pipeline:
  - name: train
    matrix: {lr: [1, 2, 3, 4]}
    max_parallel: 2
    command: "sleep 0.4; echo {{matrix.lr}} > m{{matrix.lr}}.txt"
    output: m{{matrix.lr}}.txt
  - {name: compare, command: "cat {{steps.train.outputs}} > all.txt", depends_on: [train]}
"""
    run_id = await client.submit(text, workdir=str(tmp_path))
    most = 0
    while (run := await client.get_run(run_id)).state not in {"succeeded", "failed"}:
        most = max(most, sum(s.state == "running" and s.group == "train" for s in run.steps))
        await asyncio.sleep(0.03)
    assert run.state == "succeeded"
    assert 1 <= most <= 2
    assert [s.name for s in run.steps] == ["train-lr1", "train-lr2", "train-lr3", "train-lr4",
                                           "compare"]
    assert (tmp_path / "all.txt").read_text() == "1\n2\n3\n4\n"


REUSABLE = """pipeline:
  - name: prep
    command: "echo ran >> prep.log; cat input.txt > prepared.txt"
    inputs: [input.txt]
    output: prepared.txt
  - name: train
    depends_on: [prep]
    command: "echo ran >> train.log; cat {{steps.prep.output}} > model.txt"
    output: model.txt
"""


async def test_identical_steps_reuse_earlier_results_until_an_input_changes(
        client: Client, tmp_path: Path) -> None:
    (tmp_path / "input.txt").write_text("v1")
    first = await finished_run(client, await client.submit(REUSABLE, workdir=str(tmp_path)))
    assert first.state == "succeeded"
    second = await finished_run(client, await client.submit(REUSABLE, workdir=str(tmp_path)))
    assert second.state == "succeeded"
    assert [s.cached_from for s in second.steps] == [f"{first.run_id}/prep",
                                                     f"{first.run_id}/train"]
    assert (tmp_path / "prep.log").read_text() == "ran\n"
    plan = await client.plan(REUSABLE, workdir=str(tmp_path))
    assert [s.reuse for s in plan.steps] == [f"{first.run_id}/prep", f"{first.run_id}/train"]
    assert all(s.estimated_s is not None and s.estimated_s >= 0 for s in plan.steps)
    assert plan.steps[0].start_after_s == 0.0
    assert plan.steps[1].start_after_s == plan.steps[0].estimated_s
    assert "earlier run" in plan.estimate_basis
    (tmp_path / "input.txt").write_text("v2")
    third = await finished_run(client, await client.submit(REUSABLE, workdir=str(tmp_path)))
    assert [s.cached_from for s in third.steps] == ["", ""]
    assert (tmp_path / "model.txt").read_text() == "v2"
    fourth = await finished_run(client, await client.submit(REUSABLE, workdir=str(tmp_path),
                                                        no_cache=True))
    assert [s.cached_from for s in fourth.steps] == ["", ""]
    assert (tmp_path / "prep.log").read_text() == "ran\n" * 3


async def test_retry_run_reruns_only_what_did_not_succeed(client: Client,
                                                          tmp_path: Path) -> None:
    text = """pipeline:
  - {name: good, command: "echo ran >> good.log"}
  - {name: needs_flag, command: "echo ran >> flag.log; test -f flag", depends_on: [good]}
  - {name: last, command: "true", depends_on: [needs_flag]}
"""
    run = await finished_run(client, await client.submit(text, workdir=str(tmp_path)))
    assert run.state == "failed"
    done = await finished_run(client, await client.submit(
        "pipeline:\n  - {name: a, command: 'true'}\n", workdir=str(tmp_path)))
    with pytest.raises(ClientError, match="succeeded: every step has its results"):
        await client.retry(done.run_id)
    (tmp_path / "flag").write_text("")
    state, steps = await client.retry(run.run_id)
    assert steps == ["needs_flag", "last"]
    assert state == "running"
    again = await finished_run(client, run.run_id)
    assert again.state == "succeeded"
    assert (tmp_path / "good.log").read_text() == "ran\n"
    assert (tmp_path / "flag.log").read_text() == "ran\nran\n"
    needs_flag = again.step("needs_flag")
    assert needs_flag is not None
    assert needs_flag.attempt == 2


async def test_cancelling_one_step_lets_the_others_finish(client: Client,
                                                          tmp_path: Path) -> None:
    text = """pipeline:
  - {name: long, command: "sleep 120"}
  - {name: after_long, command: "true", depends_on: [long]}
  - {name: other, command: "sleep 1; echo done > other.txt"}
"""
    run_id = await client.submit(text, workdir=str(tmp_path))
    deadline = time.monotonic() + 20
    while (await client.get_run(run_id)).step("long").state != "running":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await client.cancel(run_id, "not needed", step="long")
    run = await finished_run(client, run_id)
    assert {s.name: s.state for s in run.steps} == {
        "long": "cancelled", "after_long": "skipped", "other": "succeeded"}
    assert run.state == "cancelled"
    with pytest.raises(ClientError, match="has no step 'lnog' \\(did you mean `long`\\?\\)"):
        await client.cancel(run_id, step="lnog")


async def test_run_history_filters_and_pages(client: Client, tmp_path: Path) -> None:
    ok = "pipeline:\n  - {name: a, command: 'true'}\n"
    bad = "pipeline:\n  - {name: a, command: 'false'}\n"
    mine = [await client.submit(ok, user="hist-ada", workdir=str(tmp_path)) for _ in range(3)]
    mine.append(await client.submit(bad, user="hist-ada", workdir=str(tmp_path)))
    for run_id in mine:
        await finished_run(client, run_id)
    runs, _ = await client.list_runs(100, user="hist-ada")
    assert [r.run_id for r in runs] == sorted(mine, reverse=True)
    failed, _ = await client.list_runs(100, user="hist-ada", states=["failed"])
    assert [r.run_id for r in failed] == [mine[-1]]
    seen: list[str] = []
    token = ""
    while True:
        page, token = await client.list_runs(1, user="hist-ada", page_token=token)
        seen.extend(r.run_id for r in page)
        if not token:
            break
    assert seen == sorted(mine, reverse=True)
    assert (await client.list_runs(10, user="hist-ada", since=time.time() + 60))[0] == []


async def test_a_watch_resumes_after_the_last_event_it_saw(client: Client,
                                                           tmp_path: Path) -> None:
    text = "pipeline:\n  - {name: a, command: 'sleep 0.5'}\n  - {name: b, command: 'true', " \
           "depends_on: [a]}\n"
    run_id = await client.submit(text, workdir=str(tmp_path))
    first: list[RunEvent] = []
    async for item in client.watch(run_id):
        if isinstance(item, RunEvent):
            first.append(item)
            if item.step == "a" and item.state == "running":
                break
    cut = first[-1].sequence
    assert cut > 0
    items = [i async for i in client.watch(run_id, after_sequence=cut)]
    rest = [i for i in items if isinstance(i, RunEvent)]
    assert len(rest) == len(items)
    assert all(i.sequence > cut for i in rest)
    assert ("a", "succeeded") in {(i.step, i.state) for i in rest}
    assert rest[-1].final
    last = rest[-1].sequence
    again = [i async for i in client.watch(run_id, after_sequence=last)]
    # Resuming after the final event: only what came later (the report), then the end.
    assert {i.type for i in again if isinstance(i, RunEvent)} <= {"report_ready"}
    assert len(again) <= 1


async def test_steps_no_node_can_run_are_refused_with_the_reason(client: Client) -> None:
    with pytest.raises(PipelineRejected) as info:
        await client.submit("pipeline:\n  - {name: big, command: x, resources: {gpus: 4}}\n",
                            source_name="big.yaml")
    assert "step big: needs 4 GPU(s) on one node; the most on a node is 2" in str(info.value)
    assert "node-1 (2 GPU" in str(info.value)


async def test_unknown_ids_and_bad_arguments(client: Client, cluster: Cluster) -> None:
    from m27.v1 import pipeline_pb2 as pb
    from m27.v1 import pipeline_pb2_grpc as pb_grpc

    async with cluster.access.channel(cluster.api) as channel:
        stub = pb_grpc.PipelineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListRuns(pb.ListRunsRequest(limit=5000))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListRuns(pb.ListRunsRequest(page_token="../x"))  # noqa: S106
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.RetryRun(pb.RetryRunRequest(run_id="r-20000101-000000-000000"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
