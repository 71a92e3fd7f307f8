"""How a task's end is reported: its cause, its reason, and which declared outputs are missing."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from m27.common.events import StartTask
from m27.common.model import ExitCause
from m27.node_agent._ledger import LedgerTask, orphan_exit
from m27.node_agent._process import missing_outputs, read_tail
from m27.node_agent._tasks import (
    NOT_STARTED_EXIT_CODE,
    Ending,
    StopRequest,
    ending,
    node_stopping,
    not_started_exit,
    output_path,
    stop_requested,
    superseded_by,
    task_paths,
    timed_out,
    timeout_of,
)

HOME = Path("/data/m27")
RUN = "r-20250101-120000-abcdef"


def start(**changes: Any) -> StartTask:
    fields: dict[str, Any] = {
        "at": 1.0, "task_id": f"{RUN}/train", "run_id": RUN, "step": "train", "attempt": 1,
        "step_type": "cpu", "command": "true",
    }
    fields.update(changes)
    return StartTask(**fields)


# ---------------------------------------------------------------- the cause of each end


@pytest.mark.parametrize(("returncode", "stop", "killed_after_s", "expected"), [
    (0, None, None, Ending(0, None, "exit", "exit code 0", check_outputs=True)),
    (3, None, None, Ending(3, None, "exit", "exit code 3", check_outputs=False)),
    # a signal from outside the agent (OOM killer, the user): the program's own end
    (-9, None, None, Ending(137, 9, "exit", "killed by SIGKILL", check_outputs=False)),
    (-15, timed_out(2), None,
     Ending(143, 15, "timeout", "killed by SIGTERM: timed out after 2s", check_outputs=False)),
    (-9, timed_out(1.5), 10.0,
     Ending(137, 9, "timeout",
            "killed by SIGKILL: timed out after 1.5s (SIGKILL after 10s grace)", False)),
    # it caught SIGTERM and exited 0: still a timeout, and its outputs are not vouched for
    (0, timed_out(2), None, Ending(0, None, "timeout", "exit code 0: timed out after 2s", False)),
    (-15, stop_requested("cancelled"), None,
     Ending(143, 15, "stopped", "killed by SIGTERM: stopped: cancelled", False)),
    (-15, stop_requested(""), None,
     Ending(143, 15, "stopped", "killed by SIGTERM: stopped", False)),
    (0, stop_requested("preempted"), None,
     Ending(0, None, "stopped", "exit code 0: stopped: preempted", False)),
    (-15, superseded_by(2), None,
     Ending(143, 15, "superseded", "killed by SIGTERM: superseded by attempt 2", False)),
    (-15, node_stopping("node agent stopped"), None,
     Ending(143, 15, "node_stopped", "killed by SIGTERM: node agent stopped", False)),
])
def test_an_ending_takes_its_cause_from_the_stop_that_caused_it(
        returncode: int, stop: StopRequest | None, killed_after_s: float | None,
        expected: Ending) -> None:
    assert ending(returncode, stop, killed_after_s) == expected


@pytest.mark.parametrize(("request_", "cause"), [
    (stop_requested("x"), "stopped"), (superseded_by(3), "superseded"),
    (timed_out(60), "timeout"), (node_stopping("bye"), "node_stopped"),
])
def test_each_way_the_agent_stops_a_task_has_its_own_cause(request_: StopRequest,
                                                           cause: ExitCause) -> None:
    assert request_.cause == cause


def test_a_task_that_cannot_start_is_not_started() -> None:
    cmd = start()
    event = not_started_exit(cmd, "n1", task_paths(HOME, cmd), "no such dir", now=5.0)
    assert (event.cause, event.started, event.exit_code) == ("not_started", False,
                                                             NOT_STARTED_EXIT_CODE)
    assert event.reason == "could not start: no such dir"
    assert event.missing_outputs == ()
    assert event.stderr_path == str(HOME / "runs" / RUN / "logs" / "train.1.err")


@pytest.mark.parametrize("killed", [0, 2])
def test_an_orphan_reaped_by_a_restarted_agent_is_agent_restarted(killed: int) -> None:
    entry = LedgerTask(task_id=f"{RUN}/train", run_id=RUN, step="train", attempt=1, pid=42,
                       started_at=1.0)
    assert orphan_exit(entry, "n1", killed, now=2.0).cause == "agent_restarted"


@pytest.mark.parametrize(("timeout_s", "expected"), [
    (None, None), (2.5, 2.5), (0.0, None), (-1.0, None), (math.inf, None), (math.nan, None),
])
def test_only_a_positive_finite_timeout_is_applied(timeout_s: float | None,
                                                   expected: float | None) -> None:
    assert timeout_of(start(timeout_s=timeout_s)) == expected


# ---------------------------------------------------------------- declared outputs


@pytest.mark.parametrize(("workdir", "output", "expected"), [
    ("", "model.pt", f"{HOME}/runs/{RUN}/work/model.pt"),
    ("sub", "out/model.pt", f"{HOME}/runs/{RUN}/work/sub/out/model.pt"),
    ("/srv/exp", "model.pt", "/srv/exp/model.pt"),
    ("/srv/exp", "/scratch/model.pt", "/scratch/model.pt"),
    ("/srv/exp", "../shared/x", "/srv/exp/../shared/x"),  # `..` is the OS's to resolve
    ("/srv/exp", "ckpt/", "/srv/exp/ckpt/"),  # so is a trailing slash: a directory
])
def test_an_output_is_found_in_the_directory_the_task_ran_in(workdir: str, output: str,
                                                             expected: str) -> None:
    assert output_path(task_paths(HOME, start(workdir=workdir)).workdir, output) == expected


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """`<tmp>/work` holding what a step left behind, and `<tmp>/elsewhere.txt` beside it."""
    work = tmp_path / "work"
    (work / "dir_out").mkdir(parents=True)
    (work / "sub").mkdir()
    (work / "made.txt").write_text("x")
    (work / "sub" / "deep.txt").write_text("x")
    (work / "empty.txt").touch()
    os.mkfifo(work / "pipe")
    (work / "dangling").symlink_to(tmp_path / "nowhere")
    (work / "link").symlink_to(work / "made.txt")
    (tmp_path / "elsewhere.txt").write_text("x")
    return work


@pytest.mark.parametrize(("outputs", "missing"), [
    ((), ()),
    (("made.txt",), ()),
    (("made.txt", "missing.txt", "dir_out"), ("missing.txt",)),
    (("b.txt", "made.txt", "a.txt"), ("b.txt", "a.txt")),  # declared order is kept
    (("sub/deep.txt", "sub/nope.txt", "nodir/x"), ("sub/nope.txt", "nodir/x")),
    (("dir_out/", "made.txt/"), ("made.txt/",)),  # a trailing slash asks for a directory
    (("empty.txt",), ()),  # existing is enough, whatever the size
    (("pipe",), ()),  # a FIFO exists; it is never opened, so it cannot block
    (("link", "dangling"), ("dangling",)),  # symlinks are followed
    (("{tmp}/elsewhere.txt", "{tmp}/gone.txt"), ("{tmp}/gone.txt",)),  # absolute: as given
    (("../elsewhere.txt",), ()),  # relative to the workdir, not to the agent's cwd
    (("elsewhere.txt",), ("elsewhere.txt",)),
    (("bad\0name", "x" * 5000, "made.txt"), ("bad\0name", "x" * 5000)),  # unstat-able: missing
])
def test_missing_outputs(tree: Path, outputs: tuple[str, ...], missing: tuple[str, ...],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = str(tree.parent)
    monkeypatch.chdir(tree.parent)  # "elsewhere.txt" is there: it must not count
    declared = tuple(o.replace("{tmp}", tmp) for o in outputs)
    assert missing_outputs(tree, declared) == tuple(m.replace("{tmp}", tmp) for m in missing)


def test_an_output_the_agent_may_not_look_at_counts_as_missing(
        tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).endswith("locked/secret"):  # as in a directory without search right
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert missing_outputs(tree, ("locked/secret", "made.txt")) == ("locked/secret",)


def test_a_log_replaced_by_a_fifo_reads_as_empty_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "s1.1.out"
    os.mkfifo(fifo)
    assert read_tail(fifo, 64) == ""
    assert read_tail(tmp_path, 64) == ""  # a directory neither
