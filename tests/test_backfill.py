"""Backfill end to end, with a real node-agent on one simulated GPU (its utilization is
modelled from the CPU time of each task's processes: a busy loop is a busy GPU, a sleep an
idle one).

The main step holds the whole GPU and alternates compute and I/O phases, announcing each
with `m27.train.report_phase`. When it reports `io`, the agent publishes `task_idle`, and
the scheduler starts a waiting background step in the idle capacity (a placement with the
main step as its lender). When the main step computes again (`task_busy`), the backfill is
paused (SIGSTOP through the agent) and it is resumed at the next I/O phase; it finishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from m27.client import Client
from tests.scheduling_support import (
    COUNTER,
    FAST_POLICY,
    agent_system,
    poll_queue,
    scheduler_log,
)
from tests.support import Cluster, finished_run, lines, service_log, wait_for

pytestmark = pytest.mark.integration

#: compute 2 s, I/O 5 s, compute 5 s, I/O 5 s, compute 1 s; each phase start logged.
MAIN: Final = '''\
import time
from m27.train import report_phase
def mark(what):
    with open("main.phases", "a") as log:
        log.write(f"{what} {time.time():.3f}\\n")
def compute(seconds):
    report_phase("compute")
    mark("compute")
    end = time.time() + seconds
    while time.time() < end:
        pass
def io(seconds):
    report_phase("io")
    mark("io")
    time.sleep(seconds)
compute(2); io(5); compute(5); io(5); compute(1)
mark("end")
'''
#: GPU memory asked for explicitly: what the main step leaves free is what a backfill may use
#: (16 GiB simulated GPUs).
MAIN_PIPELINE: Final = ("pipeline:\n  - {name: train, type: gpu, resources: {gpu_memory: 8GiB}, "
                        "command: '\"$M27_PYTHON\" main.py'}\n")
BACKFILL_PIPELINE: Final = ("priority: low\npreemptible: true\npipeline:\n"
                            "  - {name: prep, type: gpu, resources: {gpu_memory: 4GiB}, "
                            "command: '\"$M27_PYTHON\" counter.py prep 80'}\n")


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    yield from agent_system(tmp_path, "node-1", env={**FAST_POLICY, "M27_NODE_IDLE_SAMPLES": "2"})


def phases(path: Path) -> list[tuple[str, float]]:
    return [(parts[0], float(parts[1])) for parts in (line.split() for line in lines(path))]


def ticks(path: Path) -> list[float]:
    """When the backfill counted (it counts every 0.1 s while it is not paused)."""
    return [float(parts[2]) for parts in (line.split() for line in lines(path))
            if len(parts) == 3]


def workdir(tmp_path: Path, main: str, **more: str) -> Path:
    """A run directory with the main step's program, the counter and `more` (name: text)."""
    work = tmp_path / "work"
    work.mkdir()
    for name, text in {"main.py": main, "counter.py": COUNTER, **more}.items():
        (work / name).write_text(text)
    return work


async def test_an_idle_report_starts_a_backfill_that_is_paused_while_the_main_task_computes(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    work = workdir(tmp_path, MAIN)
    main = await client.submit(MAIN_PIPELINE, workdir=str(work))
    await wait_for(lambda: bool(phases(work / "main.phases")), "the main step does not run")
    backfill = await client.submit(BACKFILL_PIPELINE, workdir=str(work))
    # While the main step computes, the background step waits: the GPU is taken.
    waiting = await poll_queue(
        system, lambda items: [i for i in items if i.task_id == f"{backfill}/prep"],
        "the background step is not queued", explain=True)
    assert (waiting[0].state, waiting[0].tier) == ("waiting", "background"), waiting
    assert waiting[0].explanation is not None
    assert "background tier" in waiting[0].reason

    main_run = await finished_run(client, main)
    backfill_run = await finished_run(client, backfill, timeout=60)
    assert (main_run.state, backfill_run.state) == ("succeeded", "succeeded"), system.logs()

    marks = phases(work / "main.phases")
    assert [m for m, _ in marks] == ["compute", "io", "compute", "io", "compute", "end"]
    (_, io1), (_, compute2), (_, io2) = marks[1], marks[2], marks[3]
    counted = ticks(work / "prep.log")
    # It started only once the main step had announced its I/O phase ...
    assert counted[0] > io1, (counted[0], marks)
    assert counted[0] < compute2, "it did not start within the first I/O phase"
    # ... sharing the main step's GPU, as a backfill into it.
    prep = backfill_run.steps[0]
    assert (prep.node_id, prep.gpu_ids, prep.attempt) == ("node-1", (0,), 1)
    log = scheduler_log(system)
    assert f"backfill: {main}/train's" in log
    # While the main step computed again it was paused: it counted nothing for seconds,
    # and went on in the next I/O phase.
    during = [t for t in counted if compute2 + 2.5 < t < io2]
    assert not during, f"counted while the lender was busy: {during}"
    assert any(io2 < t for t in counted), "never resumed"
    assert "task.pause_sent" in log
    assert "task.resume_sent" in log
    agent = service_log(system.processes["agent-node-1"])
    assert "task.paused" in agent
    assert "task.resumed" in agent
    assert lines(work / "prep.log")[-1].split()[1] == "80"


#: compute 2 s, I/O 5 s, then computes for a minute: the backfill is paused all that time.
LONG_MAIN: Final = MAIN.replace("compute(2); io(5); compute(5); io(5); compute(1)",
                                "compute(2); io(5); compute(60)")


async def test_a_paused_backfill_that_times_out_gets_its_sigterm_at_once(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    """A SIGSTOPped process sees no SIGTERM until it is continued. The scheduler continues a
    paused task it preempts or cancels; a stop the agent makes on its own (here the step's
    `timeout:`) used to leave it paused for the whole grace period, to die of SIGKILL
    without its checkpoint. The agent now continues it, so it checkpoints and exits."""
    work = workdir(tmp_path, LONG_MAIN)
    main = await client.submit(MAIN_PIPELINE, workdir=str(work))
    await wait_for(lambda: bool(phases(work / "main.phases")), "the main step does not run")
    pipeline = BACKFILL_PIPELINE.replace(
        "prep 80'}", "prep 900', timeout: 9s, retries: {failure: 0}}")
    backfill = await client.submit(pipeline, workdir=str(work))
    agent = system.processes["agent-node-1"]
    await wait_for(lambda: "task.paused" in service_log(agent), "the backfill is never paused",
                   timeout=30)
    run = await finished_run(client, backfill, timeout=40)
    assert run.state == "failed", run
    step = run.steps[0]
    # Its own exit on SIGTERM (143, after saving its state), not SIGKILL's 137 at the end
    # of the agent's grace.
    assert step.exit_code == 143, step
    assert any("checkpoint" in line for line in lines(work / "prep.log"))
    await client.cancel(main, "test: done")


#: compute 2 s, then eight rounds of 4 s of I/O and 2 s of compute.
LENDER: Final = MAIN.replace("compute(2); io(5); compute(5); io(5); compute(1)",
                             "compute(2)\nfor _ in range(8):\n    io(4); compute(2)")
SWEEP: Final = ("priority: low\npreemptible: true\npipeline:\n"
                "  - {{name: sweep, resources: {{gpus: 0.5, gpu_memory: 4GiB}}, "
                "command: '\"$M27_PYTHON\" counter.py {name} 3000'}}\n")
USER_STEP: Final = ("pipeline:\n  - {name: analysis, resources: {gpus: 0.5, gpu_memory: 4GiB}, "
                    "command: '\"$M27_PYTHON\" counter.py analysis 20'}\n")


async def test_background_backfills_yield_an_idle_share_to_a_ready_pool_step(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    """The service runs the same rule as the simulator (docs/scheduling.md, "Tiers, ready
    pool, idle backfill"): two background sweeps fill the main step's idle GPU; a user's
    0.5-GPU step that arrives later gets one of their places (one sweep checkpoints and is
    requeued), runs in the main step's I/O phases and is done before the main step is."""
    work = workdir(tmp_path, LENDER)
    main = await client.submit(MAIN_PIPELINE.replace("8GiB", "4GiB"), workdir=str(work))
    sweeps = [await client.submit(SWEEP.format(name=name), workdir=str(work))
              for name in ("sweep-a", "sweep-b")]
    await wait_for(lambda: all(ticks(work / f"{n}.log") for n in ("sweep-a", "sweep-b")),
                   "the sweeps never backfill into the main step", timeout=40)
    user = await client.submit(USER_STEP, workdir=str(work))
    done = await finished_run(client, user, timeout=60)
    assert done.state == "succeeded", system.logs()
    step = done.steps[0]
    assert (step.node_id, step.gpu_ids) == ("node-1", (0,))
    main_run = await client.get_run(main)
    assert main_run.state == "running", "the user step had to wait for the main step to end"
    log = scheduler_log(system)
    assert log.count("yields it to") == 1, log  # one sweep made room, not both
    assert f"backfill: {main}/train's" in log
    runs = [await client.get_run(s) for s in sweeps]
    assert sorted(r.steps[0].preemptions for r in runs) == [0, 1]
    assert any("checkpoint" in line for n in ("sweep-a", "sweep-b")
               for line in lines(work / f"{n}.log"))
    for run_id in (*sweeps, main):
        await client.cancel(run_id, "test: done")


HALF_MAIN: Final = ("pipeline:\n  - {name: train, resources: {gpus: 0.5, gpu_memory: 4GiB}, "
                    "command: '\"$M27_PYTHON\" main.py'}\n")
#: Busy (a busy loop is a busy simulated GPU) for 12 s, so it lends nothing.
BUSY: Final = ("import pathlib, time\npathlib.Path('busy.started').touch()\n"
                "end = time.time() + 12\nwhile time.time() < end:\n    pass\n")
HOLD: Final = ("pipeline:\n  - {name: hold, resources: {gpus: 0.5, gpu_memory: 4GiB}, "
               "command: '\"$M27_PYTHON\" busy.py'}\n")
MOVER: Final = ("pipeline:\n  - {name: user, resources: {gpus: 0.5, gpu_memory: 4GiB}, "
                "checkpoint: 2s, checkpoint_signal: none, "
                "command: '\"$M27_PYTHON\" counter.py user 150'}\n")


async def test_a_ready_pool_backfill_moves_to_a_share_of_its_own_when_one_frees(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    """The GPU is taken by two half-GPU steps (the main step, with I/O phases, and one
    that computes for 12 s); a user's checkpointing half-GPU step starts as a backfill in
    the main step's idle share. When the other half frees, it checkpoints, is requeued and
    resumes there, with a share of its own, before the main step ends."""
    work = workdir(tmp_path, LENDER, **{"busy.py": BUSY})
    main = await client.submit(HALF_MAIN, workdir=str(work))
    hold = await client.submit(HOLD, workdir=str(work))
    await wait_for(lambda: (work / "busy.started").exists(), "the other step does not run")
    user = await client.submit(MOVER, workdir=str(work))
    done = await finished_run(client, user, timeout=90)
    assert done.state == "succeeded", system.logs()
    step = done.steps[0]
    assert (step.attempt, step.preemptions) == (2, 1), step
    assert (await client.get_run(hold)).state == "succeeded"
    assert (await client.get_run(main)).state == "running", "it waited for the main step"
    log = scheduler_log(system)
    assert f"backfill: {main}/train's" in log
    assert "moves to capacity of its own" in log
    # It resumed from its checkpoint: the second attempt went on where the first stopped.
    counted = [line.split() for line in lines(work / "user.log")]
    first = [int(c[1]) for c in counted if c[0] == "1" and c[1].isdigit()]
    second = [int(c[1]) for c in counted if c[0] == "2" and c[1].isdigit()]
    assert first
    assert second
    assert second[0] == first[-1] + 1
    await client.cancel(main, "test: done")
