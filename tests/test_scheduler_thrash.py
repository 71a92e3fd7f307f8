"""No preemption thrash end to end: the simulator's minimal livelock case, compressed about
100× (seconds instead of minutes), with real processes on one node with one simulated GPU.

Six background steps (priority low, preemptible, 0.4 GPU each) are submitted at once. Each
attempt stages its inputs first (an I/O phase), then computes 18 s in all, with an I/O
phase of 3 s after every 3 s of compute; each phase is announced with
`m27.train.report_phase`, so the agent reports the step idle in its I/O phases and the
scheduler backfills waiting ones into its share. On SIGTERM a step writes a checkpoint of
its progress (which takes 2 s) and exits; a later attempt resumes from it. Once two hold
their own share and one more runs as a backfill in one of them, an "MD" step arrives:
priority normal, one whole GPU, not preemptible, 20 s of compute with short I/O phases.

Under the old policy the simulator livelocked here (docs/scheduling.md, "Thrash"): the MD
step preempted the two lenders only; their backfills inherited the share freed for it; it
preempted them at once (a background task had no minimum runtime), and in that same cycle
the waiting background steps were backfilled into them (still staging, so idle) and
inherited the share in turn, and so on. Now a lender's backfills are stopped with it,
nothing is lent out of capacity being freed, and min runtime holds for every tier.

In the service the old chain ends after its second round, because a backfill whose lender
has ended keeps its placement's `lender` and so never lends its own share (the simulator
clears it); its preemption count here is 4 as well. What gives the old policy away is that
second round: the backfills were stopped only once their lenders had checkpointed. So the
test checks that the MD step stops everything it needs in one round.

A checkpoint on SIGTERM takes 2 s, as in the simulator, where a preempted task stops only
at the end of its grace period: that is the margin between one round of stops and two.
Each attempt stages for 3 s (the minimal case's 180 s would be 1.8 s) so that a backfill
is past its minimum runtime while its lender is still staging, and is preempted while it
runs (a paused one is continued by the scheduler before its SIGTERM, but would checkpoint
later).

What is checked: every step succeeds; the MD step runs once (one attempt, never stopped);
it preempts what holds the GPU when it arrives in one round; there are at most
`MAX_PREEMPTIONS` preemptions in all; each background step resumes where its preempted
attempt checkpointed (no work redone or skipped). The bound: the MD step is the only task
that may preempt anything (background tasks never do), and it preempts only what holds
the GPU when it arrives, each task once: at most two lenders of 0.4 GPU (a third would not
fit beside them) and at most one backfill in each (a lender's 0.4 GPU share takes one 0.4
backfill), so 4. Once the MD step runs, it is not preemptible and background work only
waits or backfills into it; after it is done, nothing asks for a preemption. A chain of
preemptions passes that bound within seconds, so the test then fails fast instead of
timing out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from m27.client import Client
from m27.common.model import RunRecord
from tests.scheduling_support import FAST_POLICY, agent_system, queue, scheduler_log
from tests.support import Cluster, lines

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

#: The simulator's minimal case, compressed ~100× (one unit of work: 0.1 s of compute).
BACKGROUND_STEPS: Final = 6
PREP_UNITS: Final = 180  # 1800 s of compute → 18 s
PREP_IO_EVERY: Final = 30  # an I/O phase after every 300 s of compute → 3 s
PREP_IO_S: Final = 3.0  # the I/O phase: 300 s → 3 s
PREP_STAGE_S: Final = 3.0  # staging its inputs: 180 s (see the module docstring)
PREP_STOP_S: Final = 2.0  # writing the checkpoint on SIGTERM (see the module docstring)
MD_UNITS: Final = 200  # 7200 s → 20 s (shortened further: the test's time)
MD_IO_EVERY: Final = 60  # I/O every 600 s of compute → 6 s
MD_IO_S: Final = 1.3  # 132 s → 1.3 s
#: See the module docstring: two lenders and one backfill in each.
MAX_PREEMPTIONS: Final = 4

#: Usage: phases.py NAME UNITS IO_EVERY IO_S STAGE_S STOP_S. An I/O phase of STAGE_S first
#: (staging), then UNITS units of compute (0.1 s each, about a third of it spent spinning,
#: which the simulated GPU sees as load), with an I/O phase of IO_S after every IO_EVERY
#: units. Each unit done is appended to NAME.log as "<attempt> <unit> <time>". On SIGTERM
#: ("<attempt> stop <unit> <time>" logged) it takes STOP_S to write its checkpoint: the
#: units done into NAME.state ("<attempt> checkpoint <unit> <time>" logged), then exits
#: 143; a later attempt resumes after the saved unit.
#: SIGTERM is blocked while a unit is counted and logged, so the state and the log agree.
PHASES: Final = '''\
import os, pathlib, signal, sys, time
from m27.train import report_phase
name, total, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
io_s, stage_s, stop_s = float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
state = pathlib.Path(f"{name}.state")
i = start = int(state.read_text()) if state.exists() else 0
attempt = os.environ.get("M27_ATTEMPT", "-")
print(f"attempt {attempt} resumes at {i}", flush=True)
def log(line):
    with open(f"{name}.log", "a") as out:
        out.write(line + "\\n")
def checkpoint_and_stop(signum, frame):
    log(f"{attempt} stop {i} {time.time():.3f}")
    time.sleep(stop_s)
    state.write_text(str(i))
    log(f"{attempt} checkpoint {i} {time.time():.3f}")
    sys.exit(143)
signal.signal(signal.SIGTERM, checkpoint_and_stop)
def io(seconds):
    report_phase("io")
    time.sleep(seconds)
    report_phase("compute")
if stage_s > 0:
    io(stage_s)
report_phase("compute")
while i < total:
    if i != start and i % every == 0:
        io(io_s)
    end = time.monotonic() + 0.035
    while time.monotonic() < end:
        pass
    time.sleep(0.065)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    i += 1
    log(f"{attempt} {i} {time.time():.3f}")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
state.write_text(str(i))
'''


def _prep_step(n: int) -> str:
    return (f"  - {{name: prep-{n}, type: gpu_light, resources: {{gpus: 0.4, gpu_memory: 2GiB}}, "
            f"command: '\"$M27_PYTHON\" phases.py prep-{n} {PREP_UNITS} {PREP_IO_EVERY} "
            f"{PREP_IO_S} {PREP_STAGE_S} {PREP_STOP_S}'}}\n")


#: GPU memory asked for explicitly (16 GiB simulated GPUs): the background steps' memory
#: never stops a backfill; the MD step leaves room for backfills in its I/O phases.
BACKGROUND: Final = ("priority: low\npreemptible: true\npipeline:\n"
                     + "".join(_prep_step(n) for n in range(1, BACKGROUND_STEPS + 1)))
MD: Final = ("pipeline:\n  - {name: md, type: gpu, resources: {gpus: 1, gpu_memory: 8GiB}, "
             f"command: '\"$M27_PYTHON\" phases.py md {MD_UNITS} {MD_IO_EVERY} {MD_IO_S} 0 0'}}\n")


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    yield from agent_system(tmp_path, "node-1", env={**FAST_POLICY, "M27_NODE_IDLE_SAMPLES": "2"})


def preemptions(*runs: RunRecord) -> int:
    return sum(step.preemptions for run in runs for step in run.steps)


def summary(run: RunRecord) -> list[tuple[str, str, int, int]]:
    return [(s.name, s.state, s.attempt, s.preemptions) for s in run.steps]


def units(path: Path) -> dict[int, list[int]]:
    """The units each attempt logged, in order, by attempt."""
    out: dict[int, list[int]] = {}
    for parts in (line.split() for line in lines(path)):
        if parts[1] not in ("stop", "checkpoint"):
            out.setdefault(int(parts[0]), []).append(int(parts[1]))
    return out


def marks(path: Path, what: str) -> dict[int, tuple[int, float]]:
    """By attempt: the unit it was at and the time when it was told to stop (`stop`) or had
    saved its checkpoint (`checkpoint`)."""
    return {int(parts[0]): (int(parts[2]), float(parts[3]))
            for parts in (line.split() for line in lines(path)) if parts[1] == what}


async def test_the_minimal_livelock_case_finishes_with_at_most_a_few_preemptions(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "phases.py").write_text(PHASES)
    background = await client.submit(BACKGROUND, workdir=str(work))

    # The MD step arrives once the GPU is shared out: two background steps hold their own
    # share and a third runs as a backfill in the idle share of one of them.
    deadline = time.monotonic() + 60
    while True:
        items = [i for i in await queue(system) if i.run_id == background]
        held = [i for i in items if i.state in ("running", "paused") and not i.lender]
        lent = [i for i in items if i.state in ("running", "paused") and i.lender]
        if len(held) >= 2 and lent:
            break
        assert time.monotonic() < deadline, f"no backfill into a background step: {items}"
        await asyncio.sleep(0.1)
    md = await client.submit(MD, workdir=str(work))

    # Both runs finish; the preemptions never pass the bound (a chain of preemptions is
    # caught here within seconds, not at the timeout).
    deadline = time.monotonic() + 180
    while True:
        bg_run, md_run = await client.get_run(background), await client.get_run(md)
        count = preemptions(bg_run, md_run)
        assert count <= MAX_PREEMPTIONS, (
            f"{count} preemptions: thrash", summary(bg_run), system.logs())
        if {bg_run.state, md_run.state} <= {"succeeded", "failed", "cancelled"}:
            break
        assert time.monotonic() < deadline, (
            "not finished", summary(bg_run), summary(md_run), system.logs())
        await asyncio.sleep(0.2)
    assert (bg_run.state, md_run.state) == ("succeeded", "succeeded"), system.logs()
    assert all(s.state == "succeeded" for s in bg_run.steps), bg_run.steps

    # The MD step ran once, to the end, never stopped.
    (md_step,) = md_run.steps
    assert (md_step.attempt, md_step.preemptions) == (1, 0), md_step
    assert [h.cause for h in md_step.history] == ["exit"], md_step.history
    assert units(work / "md.log") == {1: list(range(1, MD_UNITS + 1))}

    # Every preemption was the MD step's, of what held the GPU when it came (two lenders
    # and at least one backfill); none after.
    assert 3 <= preemptions(bg_run) <= MAX_PREEMPTIONS, summary(bg_run)
    assert scheduler_log(system).count("task.preempted") <= MAX_PREEMPTIONS
    for step in bg_run.steps:
        assert step.preemptions <= 1, (step.name, step.history)
        *stopped, last = step.history
        assert last.cause == "exit", step.history
        assert all(h.cause == "preempted" and f"{md}/md" in h.reason for h in stopped), \
            step.history

    # ... all in one round: each task it stopped was told to before any of them had
    # finished its checkpoint (a lender's backfills are stopped with it; none of them is
    # left to inherit the share and be stopped in a second round).
    told = {s.name: marks(work / f"{s.name}.log", "stop") for s in bg_run.steps}
    saved = {s.name: marks(work / f"{s.name}.log", "checkpoint") for s in bg_run.steps}
    last_told = max((t for by in told.values() for _, t in by.values()), default=0.0)
    first_saved = min((t for by in saved.values() for _, t in by.values()), default=1e100)
    assert last_told < first_saved, f"more than one round of stops: {told}, {saved}"

    # Each background step resumed where its preempted attempt had checkpointed: every unit
    # done exactly once, in order, and each stop a clean checkpoint-then-stop.
    for step in bg_run.steps:
        path = work / f"{step.name}.log"
        done, at_stop = units(path), {a: u for a, (u, _) in saved[step.name].items()}
        assert sorted(at_stop) == list(range(1, step.attempt)), (step.name, lines(path))
        at = 0
        for attempt in range(1, step.attempt + 1):
            end = at_stop[attempt] if attempt < step.attempt else PREP_UNITS
            assert done.get(attempt, []) == list(range(at + 1, end + 1)), (
                f"{step.name} attempt {attempt}: work redone or skipped", lines(path))
            at = end
        resumed = at_stop[step.attempt - 1] if step.attempt > 1 else 0
        assert f"attempt {step.attempt} resumes at {resumed}" in step.stdout_tail, step
