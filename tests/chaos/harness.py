"""One chaos schedule against one fresh system: start it, submit the work, do the faults
while it runs, heal everything, wait for every run to end, gather the records, check.

    outcome = asyncio.run(run_schedule(seed=7, root=Path("chaos-7")))

The system runs with the test leases (renewal 1 s, self-fence 3 s, node lost 5 s,
scheduler lease 3 s) and a fast preemption policy, so a schedule takes a minute, not ten.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Final, TypeVar

import msgspec

from m27.client import Client
from m27.client.checkpoints import CheckpointClient
from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.common.model import RunRecord
from tests.chaos import checks, programs
from tests.chaos.checks import Evidence, FaultRecord, Outcome, RunView, StepView
from tests.chaos.faults import Live
from tests.chaos.schedule import Fault, Kind, Leases, draw
from tests.support import stored

ENV: Final = {"M27_NODE_LEASE_FENCE_AFTER": "3s", "M27_SCHEDULER_NODE_TIMEOUT": "5s",
              "M27_SCHEDULER_LEASE": "3s", "M27_SCHEDULER_MIN_RUNTIME": "1s",
              "M27_SCHEDULER_PREEMPT_GRACE": "20s", "M27_SCHEDULER_TICK": "0.5s",
              "M27_NODE_STOP_GRACE": "20s"}
LEASES: Final = Leases(fence_after_s=3.0, node_timeout_s=5.0)
T = TypeVar("T")


async def retrying(call: Callable[[], Awaitable[T]], what: str,
                   timeout: float = 120.0) -> T:
    """`call()` until it returns: the API is down while its process is killed, frozen or
    waiting for NATS."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except Exception:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: no answer within {timeout:.0f} s") from None
            await asyncio.sleep(0.5)


@functools.cache
def reference_digest(steps: int) -> str:
    """The training program run alone, with no system and no fault: its final digest."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="m27-chaos-ref-") as tmp:
        work = Path(tmp)
        programs.write_programs(work)
        env = {k: v for k, v in os.environ.items() if not k.startswith("M27_")}
        subprocess.run([sys.executable, "train.py", str(steps)], cwd=work, check=True,
                       env={**env, "CHAOS_STEP": "train"}, timeout=300, capture_output=True)
        return (work / "final.sha256").read_text()


class Submitted(msgspec.Struct, kw_only=True):
    job: programs.Job
    workdir: Path
    run_id: str = ""


class Schedule:
    """One seed's schedule on one fresh system under `root` (kept: logs, markers)."""

    def __init__(self, seed: int, root: Path, *, duration_s: float, every_s: float,
                 nodes: int = 3, kinds: Sequence[Kind] | None = None,
                 nats_servers: int = 1) -> None:
        self.seed, self.root = seed, root
        self.duration_s, self.every_s = duration_s, every_s
        self.nats_servers = nats_servers
        self.live = Live(root, nodes=nodes, env=dict(ENV), nats_servers=nats_servers)
        self.kinds = kinds
        self.faults: list[Fault] = []
        self.records: list[FaultRecord] = []
        self.locks: dict[str, asyncio.Lock] = {}
        self.work: list[Submitted] = []
        self.t0 = 0.0

    def client(self) -> Client:
        return self.live.cluster.client()

    async def call(self, what: str, fn: Callable[[Client], Awaitable[T]]) -> T:
        async def once() -> T:
            async with self.client() as client:
                return await fn(client)
        return await retrying(once, what)

    async def submit(self, item: Submitted) -> None:
        await asyncio.sleep(max(0.0, self.t0 + item.job.after_s - time.monotonic()))
        name = f"chaos-{self.seed}-{item.job.label}"
        pipeline = f"name: {name}\n{item.job.pipeline}"
        for _ in range(60):
            try:
                async with self.client() as client:
                    item.run_id = await client.submit(pipeline, workdir=str(item.workdir))
                    return
            except Exception:
                await asyncio.sleep(0.5)
                found, _ = await self.call("list runs", lambda c: c.list_runs(limit=200))
                if match := [r for r in found if r.name == name]:
                    item.run_id = match[0].run_id
                    return
        raise AssertionError(f"could not submit {name}")

    async def do(self, fault: Fault) -> None:
        """Wait for its time, then do it, wait its duration and undo it; one fault at a
        time per target (the next waits until the previous one is healed)."""
        await asyncio.sleep(max(0.0, self.t0 + fault.at_s - time.monotonic()))
        async with self.locks.setdefault(fault.target, asyncio.Lock()):
            started = time.time()
            serving = await self._inject(fault)
            self.records.append(FaultRecord(fault=fault, started_at=started,
                                            healed_at=serving[0], serving_at=serving[1]))

    async def _inject(self, fault: Fault) -> tuple[float, float | None]:
        """Do and undo `fault`: (healed at, serving again at) as wall times."""
        live, kind, target = self.live, fault.kind, fault.target
        undo: Callable[[], None]
        if kind == "kill":
            await asyncio.to_thread(live.kill, target)
            undo = functools.partial(live.restart, target)
        elif kind == "nats_restart":
            await asyncio.to_thread(live.kill_nats, target)
            undo = functools.partial(live.start_nats, target)
        elif kind == "freeze":
            live.freeze(target)
            undo = functools.partial(live.thaw, target)
        elif kind == "cut":
            live.cut(target)
            undo = functools.partial(live.reconnect, target)
        elif kind == "disk_full":
            await asyncio.to_thread(live.fill_disk)
            undo = live.empty_disk
        elif kind == "slow_disk":
            live.slow_disk()
            undo = live.fast_disk
        elif kind == "drain":
            await live.maintenance(target, "drain")
            await asyncio.sleep(fault.duration_s)
            await live.maintenance(target, "uncordon")
            return time.time(), time.time()
        else:  # kill_guard: nothing but its agent starts it again
            live.kill_guard(target)
            return time.time(), None
        await asyncio.sleep(fault.duration_s)
        healed = time.time()
        await asyncio.to_thread(undo)
        if kind == "nats_restart":  # serving again: JetStream takes writes
            await live.jetstream_ready()
        return healed, time.time()

    async def run(self) -> Outcome:
        # the fault-free training runs meanwhile (once per process), mostly while we wait
        reference = asyncio.ensure_future(asyncio.to_thread(reference_digest,
                                                            programs.TRAIN_STEPS))
        mark = time.monotonic()
        phases: dict[str, float] = {}

        def phase(name: str) -> None:
            nonlocal mark
            phases[name] = round(time.monotonic() - mark, 1)
            mark = time.monotonic()

        await asyncio.to_thread(self.live.start)
        phase("start")
        kinds = self.kinds if self.kinds is not None else self.live.kinds()
        kinds = [k for k in kinds if k in self.live.kinds()]
        self.faults = list(draw(self.seed, duration_s=self.duration_s, every_s=self.every_s,
                                nodes=len(self.live.nodes), kinds=kinds, leases=LEASES,
                                nats_servers=self.nats_servers))
        waves = max(1, round(self.duration_s / 30))
        jobs = [j for w in range(waves)
                for j in programs.jobs(wave=w, after_s=w * self.duration_s / waves)]
        for job in jobs:
            workdir = self.root / "work" / job.label
            programs.write_programs(workdir)
            self.work.append(Submitted(job=job, workdir=workdir))
        self.t0 = time.monotonic()
        await asyncio.gather(*(self.submit(w) for w in self.work),
                             *(self.do(f) for f in self.faults))
        await self.live.heal_all()
        phase("faults")
        # Work left after the faults takes well under a minute; a run still going after
        # this is stuck (reported by check_final), not slow.
        finished = await self.wait_all(deadline_s=90 + self.duration_s)
        phase("settle")
        outcome = checks.check_all(await self.evidence(finished, await reference))
        phase("gather")
        outcome.phases = phases
        return outcome

    async def wait_all(self, deadline_s: float) -> list[RunRecord]:
        """Every run once it ended, or as it is at the deadline."""
        deadline = time.monotonic() + deadline_s
        while True:
            runs = [await self.call("get run", functools.partial(_get, w.run_id))
                    for w in self.work]
            if all(r.state in checks.FINAL_RUN_STATES for r in runs) \
                    or time.monotonic() > deadline:
                return runs
            await asyncio.sleep(0.5)

    async def evidence(self, runs: list[RunRecord], reference: str) -> Evidence:
        ev = Evidence(seed=self.seed, runs=[view(w.job.label, r)
                                            for w, r in zip(self.work, runs, strict=True)],
                      faults=sorted(self.records, key=lambda f: f.started_at),
                      reference_digest=reference)
        for w, run in zip(self.work, runs, strict=True):
            for step in run.steps:
                key = f"{w.job.label}/{step.name}"
                ev.marks[key] = checks.parse_marks(_read(w.workdir / "markers" /
                                                         f"{step.name}.log"))
                ev.effects[key] = checks.parse_effects(_read(w.workdir / "effects" /
                                                             f"{step.name}.log"))
                if step.name in w.job.checkpointed:
                    ev.intervals[key] = w.job.checkpointed[step.name]
                if step.name in w.job.trains:
                    ev.digests[key] = _read(w.workdir / "final.sha256").strip()
        ev.events = await self.stored_events()
        ev.probes = await self.probes(runs)
        return ev

    async def stored_events(self) -> list[checks.StoredEvent]:
        bus = await NatsBus.open(self.live.cluster.nats_url, name="chaos-check")
        try:
            found = await stored(bus, subjects.EVENTS_STREAM)
        finally:
            await bus.close()
        return [e for seq, (_, data) in enumerate(found) if (e := stored_event(seq, data))]

    async def probes(self, runs: list[RunRecord]) -> list[checks.StaleProbe]:
        """Write a checkpoint in the name of the attempt before each retried checkpointed
        step's last: the checkpoint-store must refuse it."""
        found = []
        address = self.live.proc("checkpoint-store").grpc_address
        async with self.live.cluster.access.channel(address) as channel:
            store = CheckpointClient(channel)
            for w, run in zip(self.work, runs, strict=True):
                for step in run.steps:
                    if step.name not in w.job.checkpointed or step.attempt < 2:
                        continue
                    stale = step.attempt - 1
                    try:
                        await store.put_bytes(f"{run.run_id}/{step.name}", b"stale",
                                              attempt=stale, name="chaos-stale")
                    except Exception as exc:
                        accepted, detail = False, str(exc)[:200]
                    else:
                        accepted, detail = True, "put_bytes succeeded"
                    found.append(checks.StaleProbe(label=w.job.label, step=step.name,
                                                   attempt=stale, accepted=accepted,
                                                   detail=detail))
        return found


async def _get(run_id: str, client: Client) -> RunRecord:
    return await client.get_run(run_id)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def view(label: str, run: RunRecord) -> RunView:
    return RunView(label=label, run_id=run.run_id, state=run.state, steps=tuple(
        StepView(name=s.name, state=s.state, attempt=s.attempt, reason=s.reason,
                 history=tuple(checks.Attempt(h.attempt, h.node_id, h.cause)
                               for h in s.history))
        for s in run.steps))


def stored_event(seq: int, data: bytes) -> checks.StoredEvent | None:
    """The parts of a stored event the checks read (None: an event they do not read)."""
    try:
        event = events.decode_event(data)
    except Exception:
        return None
    tag = events.tag_of(event)
    if isinstance(event, events.TaskStarted | events.TaskExited):
        return checks.StoredEvent(seq=seq, tag=tag, run_id=event.run_id, step=event.step,
                                  attempt=event.attempt)
    if isinstance(event, events.CheckpointCommitted):
        run_id, _, step = event.task_id.partition("/")
        return checks.StoredEvent(seq=seq, tag=tag, run_id=run_id, step=step,
                                  attempt=event.attempt)
    if isinstance(event, events.RunStateChanged):
        return checks.StoredEvent(seq=seq, tag=tag, run_id=event.run_id, state=event.state)
    return None


async def run_schedule(seed: int, root: Path, *, duration_s: float = 40.0,
                       every_s: float = 5.0, kinds: Sequence[Kind] | None = None,
                       nats_servers: int = 1) -> Outcome:
    """One schedule on a fresh system under `root` (`nats_servers` 3: on a JetStream
    cluster, whose members are killed one at a time); the system is stopped afterwards
    (its logs stay under `root/system/logs`)."""
    schedule = Schedule(seed, root, duration_s=duration_s, every_s=every_s, kinds=kinds,
                        nats_servers=nats_servers)
    try:
        return await schedule.run()
    finally:
        with contextlib.suppress(Exception):
            await schedule.live.heal_all()
        await asyncio.to_thread(schedule.live.stop)
