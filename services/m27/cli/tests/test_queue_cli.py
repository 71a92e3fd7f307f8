"""`m27 queue --explain` and `m27 node …` rendering (pure)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from m27.cli._live import console
from m27.cli._queue import (
    queue_table,
    render_maintenance,
    render_queue,
    scheduler_address,
    score_line,
    wait_until_empty,
)
from m27.cli.tests.terminal import screen
from m27.client.scheduler import NodeMaintenance, QueueItem
from m27.common.errors import M27Error


def item(**fields: object) -> QueueItem:
    base: dict[str, object] = {
        "task_id": "r/b", "run_id": "r", "step": "b", "attempt": 1, "urgency": "normal",
        "user": "ada", "gpus": 0.5, "cpus": 1, "state": "waiting", "node_id": "",
        "queued_at": 100.0, "reason": "needs 0.50 GPU with 12 GiB; largest free slice is 0.30",
        "score": 165.0, "tier": "immediate"}
    return QueueItem(**{**base, **fields})  # type: ignore[arg-type]


def test_explain_breaks_the_score_down_and_says_why_it_waits() -> None:
    explanation = {"task_id": "r/b", "score": {"total": 165.0, "urgency": 100.0, "level": 40.0,
                                               "aging": 25.0, "held": 0.0,
                                               "user_level": "pi"},
                   "action": "wait", "staged_on": ["n1", "n3"], "reason": "x"}
    lines = render_queue([item(explanation=explanation),
                          item(task_id="r/a", state="running", node_id="n2", lender="r/m")],
                         now=3700.0, explain=True)
    assert "needs 0.50 GPU with 12 GiB; largest free slice is 0.30" in lines[1]
    assert "1h00m" in lines[1]
    assert lines[2].strip() == ("score 165.0 = urgency 100 + level 40 + aging 25 − held 0 "
                                "(user level pi)")
    assert "staged_on: n1, n3 (ready pool: its inputs are read ahead there)" in lines[4]
    assert lines[-2].split()[1:3] == ["r/a", "running"]
    assert lines[-2].endswith("n2 (backfill into r/m)")
    assert lines[-1].strip() == "may be preempted now"  # a running task: its protection
    assert score_line({"action": "wait"}) is None
    assert render_queue([], 0.0, False) == ["the queue is empty: nothing waits or runs"]


def test_the_ready_pool_shows_where_inputs_are_being_or_have_been_staged() -> None:
    staging, staged, both = render_queue(
        [item(staging_on=("n1",)), item(task_id="r/c", staged_on=("n2",)),
         item(task_id="r/d", staged_on=("n1", "n2"), staging_on=("n3",))],
        now=200.0, explain=False)[1:]
    assert staging.endswith("[ready pool: staging inputs on n1]")
    assert staged.endswith("[ready pool: inputs staged on n2]")
    assert both.endswith("[ready pool: inputs staged on n1, n2; staging inputs on n3]")


def test_preemptions_are_shown_and_explain_says_why_a_running_task_is_protected() -> None:
    thrashed = item(task_id="r/a", state="running", node_id="n1", preemptions=3,
                    fruitless_preemptions=3,
                    protected="preempted 3 times without progress: protected until it "
                              "commits a checkpoint")
    waiting = item(preemptions=1)
    _, running, queued = render_queue([thrashed, waiting], now=200.0, explain=False)
    assert running.endswith("n1 [preempted 3×, 3 in a row before any checkpoint]")
    assert queued.endswith("largest free slice is 0.30 [preempted 1×]")
    assert "preempted" not in render_queue([item()], now=200.0, explain=False)[1]
    explained = render_queue([thrashed, waiting], now=200.0, explain=True)
    assert explained[2].strip() == ("protected: preempted 3 times without progress: "
                                    "protected until it commits a checkpoint")
    assert len(explained) == 4  # a waiting task without an explanation gets no lines


def test_maintenance_says_whether_the_node_is_empty() -> None:
    assert render_maintenance(NodeMaintenance(node_id="n1", state="draining",
                                              reason="GPU reset", tasks=0)) == (
        "n1: draining (GPU reset); empty: a maintenance command can run now")
    assert render_maintenance(NodeMaintenance(node_id="n1", state="cordoned", tasks=2)) == (
        "n1: cordoned; 2 task(s) still placed there")
    assert render_maintenance(NodeMaintenance(node_id="n1", state="")) == (
        "n1: in service (takes new work)")


def test_the_scheduler_is_found_by_flag_environment_or_embedded_system(tmp_path: Path) -> None:
    assert scheduler_address("h:1", {"M27_SCHEDULER": "h:2"}, tmp_path) == "h:1"
    assert scheduler_address(None, {"M27_SCHEDULER": "h:2"}, tmp_path) == "h:2"
    with pytest.raises(M27Error, match="nothing is running"):
        scheduler_address(None, {}, tmp_path)


class Marks:
    """What `maintenance()` answers, call after call (the last one repeats)."""

    def __init__(self, *answers: list[NodeMaintenance]) -> None:
        self.answers = list(answers)

    async def maintenance(self) -> list[NodeMaintenance]:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def drain(tasks: int, state: str = "draining") -> list[NodeMaintenance]:
    return [NodeMaintenance(node_id="n1", state=state, tasks=tasks)]


async def test_drain_wait_shows_what_is_left_until_the_node_is_empty() -> None:
    shown: list[str] = []
    marks = Marks(drain(2), drain(2), drain(1), drain(0))
    done = await wait_until_empty(marks, "n1", 10.0, shown.append,  # type: ignore[arg-type]
                                  poll_s=0.0)
    assert done.tasks == 0
    assert shown == ["n1: waiting for 2 task(s) to finish or move ...",
                     "n1: waiting for 1 task(s) to finish or move ..."]


async def test_drain_wait_gives_up_after_its_timeout_or_when_uncordoned() -> None:
    with pytest.raises(M27Error, match="still has 1 task"):
        await wait_until_empty(Marks(drain(1)), "n1", 0.0, None,  # type: ignore[arg-type]
                               poll_s=0.0)
    uncordoned = Marks(drain(1), drain(1, state=""))
    with pytest.raises(M27Error, match="put back in service"):
        await wait_until_empty(uncordoned, "n1", 10.0, None, poll_s=0.0)  # type: ignore[arg-type]


def test_on_a_terminal_the_queue_is_a_table_cut_to_its_width_reasons_first() -> None:
    out = io.StringIO()
    items = [item(), item(task_id="r/a", state="running", node_id="n2", lender="r/m")]
    console(out, terminal=True, width=72).print(queue_table(items, now=3700.0, explain=True))
    rows = screen(out.getvalue(), 72)
    assert rows[0].split()[:3] == ["#", "TASK", "STATE"]
    assert rows[1].split()[:7] == ["1", "r/b", "waiting", "normal", "0.5", "1h00m", "—"]
    assert rows[1].endswith("…")  # the long reason gave way; every other cell is whole
    assert rows[2].split()[:3] == ["2", "r/a", "running"]
    assert rows[3].strip() == "may be preempted now"  # --explain, under its task
    assert all(len(row) <= 72 for row in rows)
