"""Load and soak: a whole m27 (nats-server and the five services as real processes, on
loopback) under many tasks, many concurrent submissions, or a steady stream for an hour.
The node-agents' GPUs are simulated (`--gpus sim:N`): this measures the control plane.

`--mode tasks`: --agents node-agents; pipelines of --steps-per-run steps (a cpu `prep`, a
`matrix:` sweep of gpu steps and one of cpu steps after it, a cpu `done` after both)
totalling --tasks steps, submitted --submit-parallel at a time, all with the result cache
off. Every step appends `run step task attempt` to a ledger file; afterwards every run must
have succeeded (GetRun) and every step must appear in the ledger exactly once. Reports
tasks/s, events/s (the JetStream streams' sequence numbers before and after; also the
writes to the task table and the run records, both KV buckets), the mean and
longest scheduling cycle (the scheduler's /metrics), and the CPU seconds and peak RSS of
every service process and nats-server.

    python bench/load.py --mode tasks [--tasks 10000] [--agents 20] [--steps-per-run 20]

`--mode submit`: --calls SubmitPipeline calls of a one-step pipeline, all started at once
(asyncio; nothing bounds them but the client), each with --call-timeout. Counts the status
codes (RESOURCE_EXHAUSTED or UNAVAILABLE is an answer, a client-side deadline is not),
the call latency (p50/p95/max, and by status code), then waits for every accepted run to
finish and checks the ledger as above. With --retry-refused a refused call is made again
after a growing pause until it is accepted (latency: until then).

    python bench/load.py --mode submit [--calls 5000] [--agents 4] [--retry-refused]

`--mode soak`: a pipeline every --interval seconds (a cpu step, two gpu steps that
checkpoint every second, a cpu step after them) for --duration seconds over --agents
agents; every --sample-every seconds the RSS (and its anonymous part: heap and stacks,
not code paged in) and CPU time of every service and of nats-server (from /proc), a
table every --print-every seconds (so a killed run still shows something), and at the
end per process: RSS first/last/max, the least-squares trend in MiB per hour over the
samples after --warmup, and CPU %. A process whose trend exceeds --leak-mib-per-hour,
over those samples and over their later half, is flagged as a suspected leak. --out
writes the result as JSON (soak mode: with every sample).

    python bench/load.py --mode soak [--duration 3600] [--agents 8] [--out soak.json]
    python bench/load.py --windows soak.json 300 3600    # trends 300–3600 s and 3600 s–end
                                                         # (of RSS, then anonymous RSS)

Every mode takes --json (the result as JSON on stdout; progress goes to stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import nats.aio.msg

from m27.common import events, proto, subjects
from m27.common.api_auth import ApiAccess
from m27.common.bus import NatsBus
from m27.common.grpc_server import CLIENT_OPTIONS
from m27.common.model import ServiceInfo
from m27.v1 import pipeline_pb2 as pb
from m27.v1 import pipeline_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support import Cluster  # the same helper the tests use

LEDGER = "ledger.txt"
RECORD = f'echo "$M27_RUN_ID $M27_STEP $M27_TASK_ID $M27_ATTEMPT" >> {LEDGER}'
FINAL = frozenset({"succeeded", "failed", "cancelled"})
#: What the system stores, counted by sequence (a KV bucket is the stream KV_<bucket>): the
#: events and commands, and the writes of the task table and of the run records.
STREAMS = (subjects.EVENTS_STREAM, subjects.COMMANDS_STREAM, f"KV_{subjects.TASKS_BUCKET}",
           f"KV_{subjects.RUNS_BUCKET}")

# ---------------------------------------------------------------- pure parts


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value that at least q of the values do not exceed."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def run_sizes(tasks: int, per_run: int, smallest: int = 4) -> list[int]:
    """Steps per pipeline: `per_run` each, the remainder in one more pipeline (or added to
    the last when it is smaller than a pipeline can be)."""
    sizes = [per_run] * (tasks // per_run)
    rest = tasks % per_run
    if rest >= smallest or (rest and not sizes):
        sizes.append(rest)
    elif rest:
        sizes[-1] += rest
    return sizes


def load_pipeline(index: int, steps: int) -> str:
    """prep (cpu) → a sweep of gpu steps and one of cpu steps → done (cpu): `steps` in all."""
    sweep = steps - 2
    gpu, cpu = sweep // 2, sweep - sweep // 2

    def axis(n: int) -> str:
        return "[" + ", ".join(str(i) for i in range(n)) + "]"

    lines = [f"name: load-{index}", "pipeline:",
             f"  - {{name: prep, type: cpu, command: '{RECORD}'}}"]
    after = []
    for name, kind, count in (("g", "gpu", gpu), ("c", "cpu", cpu)):
        if count:
            lines.append(f"  - {{name: {name}, type: {kind}, matrix: {{i: {axis(count)}}}, "
                         f"depends_on: [prep], command: '{RECORD}'}}")
            after.append(name)
    lines.append(f"  - {{name: done, type: cpu, depends_on: [{', '.join(after) or 'prep'}], "
                 f"command: '{RECORD}'}}")
    return "\n".join(lines) + "\n"


SOAK_PIPELINE = f"""\
name: soak
pipeline:
  - {{name: prep, type: cpu, command: '{RECORD}'}}
  - name: train
    type: gpu
    matrix: {{i: [0, 1]}}
    depends_on: [prep]
    checkpoint: 1s
    checkpoint_signal: none
    command: '{RECORD}; for n in 1 2 3; do echo $n > "$M27_CHECKPOINT_DIR/state"; sleep 1; done'
  - {{name: eval, type: cpu, depends_on: [train], command: '{RECORD}'}}
"""
SUBMIT_PIPELINE = f"pipeline:\n  - {{name: only, type: cpu, command: '{RECORD}'}}\n"


@dataclass(frozen=True)
class LedgerCheck:
    """What the ledger says against the steps the runs have: each must run exactly once."""

    expected: int
    recorded: int
    missing: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)  # the same attempt recorded twice
    retried: list[str] = field(default_factory=list)  # more than one attempt recorded
    unexpected: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.doubled or self.retried or self.unexpected)


def check_ledger(lines: Iterable[str], expected: Iterable[str]) -> LedgerCheck:
    """`lines`: `run step task attempt` as the steps wrote them; `expected`: `run step` of
    every step the runs have."""
    attempts: dict[str, list[str]] = {}
    recorded = 0
    for line in lines:
        fields = line.split()
        if len(fields) != 4:
            continue
        recorded += 1
        attempts.setdefault(f"{fields[0]} {fields[1]}", []).append(fields[3])
    wanted = set(expected)
    return LedgerCheck(
        expected=len(wanted), recorded=recorded,
        missing=sorted(wanted - attempts.keys()),
        doubled=sorted(k for k, a in attempts.items() if len(set(a)) < len(a)),
        retried=sorted(k for k, a in attempts.items() if len(set(a)) > 1),
        unexpected=sorted(attempts.keys() - wanted))


def trend_per_hour(samples: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, value) samples, in value per hour (0 for fewer
    than two distinct times)."""
    if len(samples) < 2:
        return 0.0
    mean_t = sum(t for t, _ in samples) / len(samples)
    mean_v = sum(v for _, v in samples) / len(samples)
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    if spread == 0:
        return 0.0
    return 3600.0 * sum((t - mean_t) * (v - mean_v) for t, v in samples) / spread


@dataclass(frozen=True)
class MemoryVerdict:
    first_mib: float
    last_mib: float
    max_mib: float
    trend_mib_per_h: float
    cpu_pct: float
    suspected_leak: bool


def memory_verdict(samples: Sequence[tuple[float, float, float]], warmup_s: float,
                   bound_mib_per_h: float) -> MemoryVerdict:
    """`samples`: (seconds since start, RSS MiB, CPU seconds) of one process. The trend is
    fitted to the samples after `warmup_s` (all of them if that leaves fewer than three).
    A leak is suspected when that trend and the trend of the later half of those samples
    both exceed `bound_mib_per_h`: growth that flattens out (caches filling) is not one."""
    settled = [(t, rss) for t, rss, _ in samples if t >= warmup_s]
    if len(settled) < 3:
        settled = [(t, rss) for t, rss, _ in samples]
    trend = trend_per_hour(settled)
    later = trend_per_hour(settled[len(settled) // 2:])
    span = samples[-1][0] - samples[0][0]
    cpu = 100.0 * (samples[-1][2] - samples[0][2]) / span if span > 0 else 0.0
    return MemoryVerdict(first_mib=samples[0][1], last_mib=samples[-1][1],
                         max_mib=max(rss for _, rss, _ in samples), trend_mib_per_h=trend,
                         cpu_pct=cpu,
                         suspected_leak=min(trend, later) > bound_mib_per_h)


def nearest(series: Sequence[tuple[float, float]], t: float) -> float:
    """The value of the sample taken nearest to time `t`."""
    return min(series, key=lambda point: abs(point[0] - t))[1]


def windowed(samples: Sequence[Mapping[str, Any]], edges: Sequence[float],
             field: str = "rss_mib") -> dict[str, dict[str, Any]]:
    """From a soak's samples (`--out`), per process: `field` (RSS, or its anonymous part
    `anon_mib`) at each edge (the sample nearest it) and the trend (MiB/h) within each
    window between consecutive edges — whether a growth levels off once, say, the first
    hour's data starts to expire. Samples without `field` (older files) are left out."""
    names = {name for sample in samples for name in sample["processes"]}
    found: dict[str, dict[str, Any]] = {}
    for name in sorted(names):
        series = [(s["t"], s["processes"][name][field]) for s in samples
                  if not math.isnan(s["processes"].get(name, {}).get(field, math.nan))]
        if not series:
            continue
        at = [nearest(series, edge) for edge in edges]
        trends = [trend_per_hour([p for p in series if start <= p[0] <= end])
                  for start, end in itertools.pairwise(edges)]
        found[name] = {"at_mib": at, "trend_mib_per_h": trends}
    return found


# ---------------------------------------------------------------- /proc


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> tuple[float, float, float]:
    """(RSS now, peak RSS, the anonymous part of RSS now) in MiB. The anonymous part is
    the heap and stacks; the rest is file-backed (code and libraries paged in as they
    are first used, which is no leak) and shared memory."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            found[key] = int(value.split()[0]) / 1024
    return (found.get("VmRSS", math.nan), found.get("VmHWM", math.nan),
            found.get("RssAnon", math.nan))


def processes(cluster: Cluster) -> dict[str, int]:
    pids = {name: proc.pid for name, proc in cluster.processes.items()}
    servers = getattr(cluster.nats, "servers", [cluster.nats])
    for i, server in enumerate(servers, 1):
        if server.pid is not None:
            pids["nats-server" if len(servers) == 1 else f"nats-server-{i}"] = server.pid
    return pids


def usage(pids: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """CPU seconds, RSS, peak RSS and anonymous RSS of each process (NaN for one that is
    gone)."""
    found = {}
    for name, pid in pids.items():
        try:
            rss, peak, anon = memory_mib(pid)
            found[name] = {"cpu_s": cpu_seconds(pid), "rss_mib": rss, "peak_rss_mib": peak,
                           "anon_mib": anon}
        except (OSError, ValueError, IndexError):
            found[name] = {"cpu_s": math.nan, "rss_mib": math.nan, "peak_rss_mib": math.nan,
                           "anon_mib": math.nan}
    return found


def exit_status(pid: int) -> str:
    """How a child of this process that is gone ended — it stays a zombie until reaped,
    so its status is still there: "killed by SIGKILL", "exit code 1" — or why not known."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return "unknown (reaped already, or not a child of the bench)"
    if got == 0:
        return "still running"
    code = os.waitstatus_to_exitcode(status)
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


# ---------------------------------------------------------------- the system


def header(args: argparse.Namespace) -> dict[str, Any]:
    return {"mode": args.mode, "agents": args.agents,
            "gpus_per_agent": f"{args.gpus} (simulated: no GPU is used)",
            "machine": platform.platform(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "load_start": list(os.getloadavg()),
            "env": list(args.env)}


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class Finals:
    """The final state of every run, as the orchestrator announces it on the bus."""

    def __init__(self) -> None:
        self.states: dict[str, str] = {}

    async def on_message(self, msg: nats.aio.msg.Msg) -> None:
        try:
            event = events.decode_event(msg.data)
        except Exception:  # not ours to judge; GetRun is the record
            return
        if isinstance(event, events.RunStateChanged) and event.state in FINAL:
            self.states[event.run_id] = event.state


async def stream_counts(bus: NatsBus) -> dict[str, int]:
    return {name: (await bus.js.stream_info(name)).state.last_seq for name in STREAMS}


async def scheduler_metrics(bus: NatsBus) -> dict[str, float]:
    """The scheduler's /metrics, where it registered its address (KV m27_services)."""
    keys = [k for k in await bus.kv_keys(subjects.SERVICES_BUCKET) if k.startswith("scheduler.")]
    got = await bus.kv_get(subjects.SERVICES_BUCKET, keys[0], ServiceInfo) if keys else None
    if got is None or not got[0].metrics_address:
        return {}
    url = f"http://{got[0].metrics_address}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    found = {}
    for line in text.decode().splitlines():
        if line.startswith("m27_scheduler_cycle"):
            name, _, value = line.rpartition(" ")
            found[name] = float(value)
    return found


def cycle_figures(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    cycles = after.get("m27_scheduler_cycles_total", 0) - before.get(
        "m27_scheduler_cycles_total", 0)
    spent = after.get("m27_scheduler_cycle_seconds_total", 0) - before.get(
        "m27_scheduler_cycle_seconds_total", 0)
    if not after:
        return {"cycles": None, "note": "the scheduler exposes no cycle metrics"}
    return {"cycles": int(cycles), "busy_s": spent,
            "mean_ms": 1e3 * spent / cycles if cycles else math.nan,
            "max_ms": 1e3 * after.get("m27_scheduler_cycle_seconds_max", math.nan)}


async def wait_finished(finals: Finals, stub: pb_grpc.PipelineServiceAsyncStub,
                        run_ids: Sequence[str], timeout: float, call_timeout: float) -> None:
    """Until every run has a final state (the bus; GetRun every 30 s for any not yet seen,
    in case an announcement went by before the subscription) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    last_poll = time.monotonic()
    while time.monotonic() < deadline:
        open_ = [r for r in run_ids if r not in finals.states]
        if not open_:
            return
        if time.monotonic() - last_poll > 30:
            last_poll = time.monotonic()
            say(f"{len(run_ids) - len(open_)} of {len(run_ids)} runs finished")
            for run_id, state in await run_states(stub, open_[:200], call_timeout):
                if state in FINAL:
                    finals.states[run_id] = state
        await asyncio.sleep(1.0)
    say(f"gave up waiting after {timeout:.0f} s")


async def run_states(stub: pb_grpc.PipelineServiceAsyncStub, run_ids: Sequence[str],
                     call_timeout: float) -> list[tuple[str, str]]:
    records = await get_runs(stub, run_ids, call_timeout)
    return [(r, "unknown" if rec is None else state_name(rec.state)) for r, rec in records]


def state_name(state: pb.RunState.ValueType) -> str:
    return proto.run_state_from_proto(state)


async def get_runs(stub: pb_grpc.PipelineServiceAsyncStub, run_ids: Sequence[str],
                   call_timeout: float, parallel: int = 16) -> list[tuple[str, Any]]:
    gate = asyncio.Semaphore(parallel)

    async def one(run_id: str) -> tuple[str, Any]:
        async with gate:
            try:
                return run_id, await stub.GetRun(pb.GetRunRequest(run_id=run_id),
                                                 timeout=call_timeout)
            except grpc.aio.AioRpcError:
                return run_id, None

    return list(await asyncio.gather(*(one(r) for r in run_ids)))


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def verify(stub: pb_grpc.PipelineServiceAsyncStub, run_ids: Sequence[str], ledger: Path,
                 call_timeout: float) -> dict[str, Any]:
    """Every run's record (GetRun) against the ledger the steps wrote."""
    records = await get_runs(stub, run_ids, call_timeout)
    states = Counter("unreadable" if rec is None else state_name(rec.state)
                     for _, rec in records)
    expected = [f"{r} {s.name}" for r, rec in records if rec is not None for s in rec.steps]
    check = check_ledger(await asyncio.to_thread(read_lines, ledger), expected)
    return {"runs": len(run_ids), "run_states": dict(states), "steps_expected": check.expected,
            "ledger_lines": check.recorded, "missing": len(check.missing),
            "doubled": len(check.doubled), "retried": len(check.retried),
            "unexpected": len(check.unexpected),
            "examples": (check.missing + check.doubled + check.retried + check.unexpected)[:5],
            "nothing_lost_or_doubled": check.ok and states.get("succeeded") == len(run_ids)}


class System:
    """A Cluster with a bus connection, a gRPC stub and a working directory for the steps."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.cluster = Cluster(root, nodes=args.agents, gpus=args.gpus,
                               env=dict(pair.split("=", 1) for pair in args.env))
        self.work = root / "work"
        self.work.mkdir()
        self.finals = Finals()
        self.args = args

    async def __aenter__(self) -> System:
        say(f"starting nats-server and {4 + self.args.agents} services")
        await asyncio.to_thread(self.cluster.start)
        self.bus = await NatsBus.open(self.cluster.nats_url, name="bench-load")
        await self.bus.nc.subscribe(subjects.RUN_STATE_ALL, cb=self.finals.on_message)
        access: ApiAccess = self.cluster.access
        self.channel = access.channel(self.cluster.api, options=CLIENT_OPTIONS)
        self.stub: pb_grpc.PipelineServiceAsyncStub = pb_grpc.PipelineServiceStub(
            self.channel)
        say(f"system up; logs under {self.cluster.root / 'logs'}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close(None)
        await self.bus.close()
        await asyncio.to_thread(self.cluster.stop)

    def request(self, pipeline: str) -> pb.SubmitPipelineRequest:
        return pb.SubmitPipelineRequest(pipeline_yaml=pipeline, workdir=str(self.work),
                                        no_cache=True)

    async def submit(self, pipeline: str) -> str:
        reply = await self.stub.SubmitPipeline(self.request(pipeline),
                                               timeout=self.args.call_timeout)
        return str(reply.run_id)

    async def snapshot(self) -> dict[str, Any]:
        return {"at": time.monotonic(), "streams": await stream_counts(self.bus),
                "scheduler": await scheduler_metrics(self.bus),
                "usage": usage(processes(self.cluster))}


def bus_figures(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    elapsed = after["at"] - before["at"]
    added = {n: after["streams"][n] - before["streams"][n] for n in STREAMS}
    return {"elapsed_s": elapsed, "messages": added,
            "events_per_s": added[subjects.EVENTS_STREAM] / elapsed,
            "kv_writes_per_s": (added[STREAMS[2]] + added[STREAMS[3]]) / elapsed,
            "commands_per_s": added[subjects.COMMANDS_STREAM] / elapsed,
            "scheduler_cycle": cycle_figures(before["scheduler"], after["scheduler"])}


def process_figures(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    return {name: {"cpu_s": now["cpu_s"] - before["usage"].get(name, now)["cpu_s"],
                   "peak_rss_mib": now["peak_rss_mib"], "rss_mib": now["rss_mib"]}
            for name, now in after["usage"].items()}


# ---------------------------------------------------------------- modes


async def tasks_mode(system: System) -> dict[str, Any]:
    args = system.args
    sizes = run_sizes(args.tasks, args.steps_per_run)
    say(f"submitting {len(sizes)} pipelines, {sum(sizes)} steps")
    before = await system.snapshot()
    gate = asyncio.Semaphore(args.submit_parallel)

    async def one(index: int, steps: int) -> str:
        async with gate:
            return await system.submit(load_pipeline(index, steps))

    run_ids = await asyncio.gather(*(one(i, n) for i, n in enumerate(sizes)))
    submitted = time.monotonic() - before["at"]
    say(f"submitted in {submitted:.1f} s; waiting for the runs")
    await wait_finished(system.finals, system.stub, run_ids, args.timeout, args.call_timeout)
    after = await system.snapshot()
    result = {"pipelines": len(sizes), "tasks": sum(sizes), "submit_s": submitted,
              **bus_figures(before, after)}
    result["tasks_per_s"] = result["tasks"] / result["elapsed_s"]
    result["processes"] = process_figures(before, after)
    say("checking every run's record against the ledger")
    result["check"] = await verify(system.stub, run_ids, system.work / LEDGER,
                                   args.call_timeout)
    return result


REFUSALS = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95),
            "max": max(values, default=math.nan)}


async def submit_mode(system: System) -> dict[str, Any]:
    args = system.args
    request = system.request(SUBMIT_PIPELINE)
    before = await system.snapshot()
    say(f"{args.calls} SubmitPipeline calls at once"
        + (" (a refused one is tried again after a pause)" if args.retry_refused else ""))
    first: Counter[str] = Counter()

    async def one(number: int) -> tuple[str, float, str, int]:
        began, tries = time.perf_counter(), 0
        while True:
            tries += 1
            try:
                reply = await system.stub.SubmitPipeline(request, timeout=args.call_timeout)
                code, run_id = "OK", str(reply.run_id)
            except grpc.aio.AioRpcError as exc:
                code, run_id = exc.code().name, ""
            if tries == 1:
                first[code] += 1
            if not (args.retry_refused and code in REFUSALS):
                return code, time.perf_counter() - began, run_id, tries
            # spread the retries out: a pause that grows, different for every call
            await asyncio.sleep(min(10.0, 0.5 * tries) * (0.5 + (number % 100) / 100))

    answers = await asyncio.gather(*(one(n) for n in range(args.calls)))
    calls_s = time.monotonic() - before["at"]
    codes = Counter(code for code, _, _, _ in answers)
    run_ids = [run for _, _, run, _ in answers if run]
    say(f"answered in {calls_s:.1f} s: {dict(codes)}; waiting for {len(run_ids)} runs")
    await wait_finished(system.finals, system.stub, run_ids, args.timeout, args.call_timeout)
    after = await system.snapshot()
    result = {"calls": args.calls, "calls_s": calls_s, "status_codes": dict(codes),
              "first_answers": dict(first), "retry_refused": args.retry_refused,
              "tries": sum(t for _, _, _, t in answers),
              "answered": sum(n for c, n in codes.items() if c != "DEADLINE_EXCEEDED"),
              "latency_s": spread([took for _, took, _, _ in answers]),
              "latency_by_code_s": {c: spread([t for code, t, _, _ in answers if code == c])
                                    for c in codes},
              **bus_figures(before, after)}
    result["processes"] = process_figures(before, after)
    result["check"] = await verify(system.stub, run_ids, system.work / LEDGER,
                                   args.call_timeout)
    return result


class Soak:
    """Submits on a steady beat and samples every process; prints as it goes."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.pids = processes(system.cluster)
        self.samples: list[dict[str, Any]] = []
        self.run_ids: list[str] = []
        self.refused = Counter[str]()
        self.began = time.monotonic()

    async def feed(self, until: float) -> None:
        args = self.system.args
        pending: set[asyncio.Task[None]] = set()
        while time.monotonic() < until:
            task = asyncio.create_task(self._submit_one())
            pending.add(task)
            task.add_done_callback(pending.discard)
            await asyncio.sleep(args.interval)
        await asyncio.gather(*pending)

    async def _submit_one(self) -> None:
        try:
            self.run_ids.append(await self.system.submit(SOAK_PIPELINE))
        except grpc.aio.AioRpcError as exc:
            self.refused[exc.code().name] += 1

    async def sample_until(self, until: float) -> None:
        args = self.system.args
        printed = 0.0
        while True:
            self.sample()
            now = time.monotonic()
            if now - printed >= args.print_every:
                printed = now
                self.print_table()
            if now >= until:
                return
            await asyncio.sleep(min(args.sample_every, max(0.0, until - now)))

    def sample(self) -> None:
        found = usage(self.pids)
        self.samples.append({"t": time.monotonic() - self.began, "runs": len(self.run_ids),
                             "finished": len(self.system.finals.states),
                             "processes": found})

    def series(self, name: str) -> list[tuple[float, float, float]]:
        return [(s["t"], s["processes"][name]["rss_mib"], s["processes"][name]["cpu_s"])
                for s in self.samples if not math.isnan(s["processes"][name]["rss_mib"])]

    def died(self) -> dict[str, float]:
        """Processes gone before the end: name → the last time (s) they were seen."""
        return {name: series[-1][0] for name in self.pids
                if (series := self.series(name)) and self.samples
                and math.isnan(self.samples[-1]["processes"][name]["rss_mib"])}

    def verdicts(self) -> dict[str, MemoryVerdict]:
        args = self.system.args
        return {name: memory_verdict(series, args.warmup, args.leak_mib_per_hour)
                for name in self.pids if (series := self.series(name))}

    def print_table(self) -> None:
        last = self.samples[-1]
        print(f"--- t={last['t']:.0f} s, runs submitted {last['runs']}, finished "
              f"{last['finished']}, refused {sum(self.refused.values())}", file=sys.stderr)
        print(f"{'process':<18}{'RSS MiB':>9}{'first':>8}{'max':>8}{'MiB/h':>8}{'CPU %':>7}",
              file=sys.stderr)
        for name, v in self.verdicts().items():
            flag = "  LEAK?" if v.suspected_leak else ""
            print(f"{name:<18}{v.last_mib:9.1f}{v.first_mib:8.1f}{v.max_mib:8.1f}"
                  f"{v.trend_mib_per_h:8.1f}{v.cpu_pct:7.1f}{flag}",
                  file=sys.stderr, flush=True)


async def soak_mode(system: System) -> dict[str, Any]:
    args = system.args
    soak = Soak(system)
    before = await system.snapshot()
    until = soak.began + args.duration
    say(f"soak: a pipeline every {args.interval:g} s for {args.duration:g} s")
    await asyncio.gather(soak.feed(until), soak.sample_until(until))
    say("soak over; waiting for the last runs")
    await wait_finished(system.finals, system.stub, soak.run_ids, 300, args.call_timeout)
    after = await system.snapshot()
    soak.sample()
    soak.print_table()
    verdicts = soak.verdicts()
    result = {"duration_s": args.duration, "runs": len(soak.run_ids),
              "refused": dict(soak.refused), **bus_figures(before, after),
              "memory": {n: vars(v) for n, v in verdicts.items()},
              "suspected_leaks": sorted(n for n, v in verdicts.items() if v.suspected_leak),
              "died": soak.died()}
    result["exits"] = {name: exit_status(soak.pids[name]) for name in result["died"]}
    result["check"] = await verify(system.stub, soak.run_ids, system.work / LEDGER,
                                   args.call_timeout)
    result["samples"] = soak.samples
    return result


MODES = {"tasks": tasks_mode, "submit": submit_mode, "soak": soak_mode}


async def main_async(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    result = header(args)
    async with System(root, args) as system:
        result.update(await MODES[args.mode](system))
    result["load_end"] = list(os.getloadavg())
    return result


# ---------------------------------------------------------------- output


def print_result(result: Mapping[str, Any]) -> None:
    print(f"m27 load bench, mode {result['mode']}: {result['agents']} node-agents with "
          f"{result['gpus_per_agent']}")
    print(f"machine: {result['machine']}, {result['cpus']} CPUs, Python {result['python']}; "
          f"load average {result['load_start'][0]:.2f} → {result['load_end'][0]:.2f}")
    if "tasks" in result:
        print(f"{result['tasks']} tasks in {result['pipelines']} pipelines: "
              f"{result['elapsed_s']:.1f} s ({result['tasks_per_s']:.1f} tasks/s; "
              f"submitting took {result['submit_s']:.1f} s)")
    if "calls" in result:
        lat = result["latency_s"]
        print(f"{result['calls']} concurrent SubmitPipeline calls in {result['calls_s']:.1f} s:"
              f" {result['answered']} answered, status codes {result['status_codes']}")
        if result["retry_refused"]:
            print(f"first answers {result['first_answers']}; {result['tries']} calls made in "
                  "all (a refused one was tried again after a pause)")
        print(f"call latency p50 {lat['p50']:.2f} s, p95 {lat['p95']:.2f} s, "
              f"max {lat['max']:.2f} s; all runs done after {result['elapsed_s']:.1f} s")
        for code, by in result["latency_by_code_s"].items():
            print(f"  {code}: p50 {by['p50']:.2f} s, p95 {by['p95']:.2f} s, max {by['max']:.2f} s")
    if "duration_s" in result:
        print(f"soak {result['duration_s']:.0f} s: {result['runs']} runs submitted, "
              f"refused {result['refused']}; suspected leaks: "
              f"{', '.join(result['suspected_leaks']) or 'none'}; gone before the end: "
              + (", ".join(f"{n} (last seen at t={t:.0f} s; {result['exits'].get(n, '?')})"
                           for n, t in result["died"].items()) or "none"))
    print(f"bus: {result['messages']} messages stored, {result['events_per_s']:.1f} events/s, "
          f"{result['commands_per_s']:.1f} commands/s, {result['kv_writes_per_s']:.1f} "
          "task-table and run-record writes/s")
    cycle = result["scheduler_cycle"]
    if cycle.get("cycles") is not None:
        print(f"scheduler: {cycle['cycles']} cycles, mean {cycle['mean_ms']:.2f} ms, "
              f"longest since start {cycle['max_ms']:.1f} ms, busy {cycle['busy_s']:.1f} s")
    print_processes(result)
    check = result["check"]
    print(f"check: {check['runs']} runs {check['run_states']}; {check['steps_expected']} "
          f"steps, {check['ledger_lines']} ledger lines; missing {check['missing']}, doubled "
          f"{check['doubled']}, retried {check['retried']}, unexpected {check['unexpected']}"
          f" → {'OK' if check['nothing_lost_or_doubled'] else 'FAILED'} {check['examples']}")


def print_processes(result: Mapping[str, Any]) -> None:
    if "processes" in result:
        print("| process | CPU s | peak RSS MiB |\n|---|---|---|")
        for name, p in result["processes"].items():
            print(f"| {name} | {p['cpu_s']:.1f} | {p['peak_rss_mib']:.1f} |")
    if "memory" in result:
        print("| process | RSS first | last | max | trend MiB/h | CPU % | leak? |")
        print("|---|---|---|---|---|---|---|")
        for name, m in result["memory"].items():
            print(f"| {name} | {m['first_mib']:.1f} | {m['last_mib']:.1f} | "
                  f"{m['max_mib']:.1f} | {m['trend_mib_per_h']:.1f} | {m['cpu_pct']:.1f} | "
                  f"{'SUSPECTED' if m['suspected_leak'] else 'no'} |")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=tuple(MODES), default="tasks")
    parser.add_argument("--agents", type=int, default=None,
                        help="node-agents (default: 20 tasks, 4 submit, 8 soak)")
    parser.add_argument("--gpus", default="sim:2", help="each agent's simulated GPUs")
    parser.add_argument("--tasks", type=int, default=10000, help="tasks mode")
    parser.add_argument("--steps-per-run", type=int, default=20, help="tasks mode (>= 4)")
    parser.add_argument("--submit-parallel", type=int, default=8,
                        help="tasks mode: submissions in flight at once")
    parser.add_argument("--calls", type=int, default=5000, help="submit mode")
    parser.add_argument("--retry-refused", action="store_true",
                        help="submit mode: try a refused call (RESOURCE_EXHAUSTED, "
                             "UNAVAILABLE) again after a growing pause, as a client should")
    parser.add_argument("--call-timeout", type=float, default=120.0,
                        help="deadline of each gRPC call (s)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="give up waiting for the runs after this long (s)")
    parser.add_argument("--duration", type=float, default=3600.0, help="soak mode (s)")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="soak mode: seconds between submissions")
    parser.add_argument("--sample-every", type=float, default=20.0, help="soak mode (s)")
    parser.add_argument("--print-every", type=float, default=300.0, help="soak mode (s)")
    parser.add_argument("--warmup", type=float, default=300.0,
                        help="soak mode: samples before this are left out of the trend (s)")
    parser.add_argument("--leak-mib-per-hour", type=float, default=20.0,
                        help="soak mode: an RSS trend above this is a suspected leak")
    parser.add_argument("--out", default="",
                        help="write the result here as JSON (soak mode: with every sample)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment for every service, e.g. a config key "
                        "(M27_CHECKPOINT_KEEP_FINISHED=10m); repeatable")
    parser.add_argument("--keep", action="store_true",
                        help="keep the system's directory (logs under <it>/logs) afterwards")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--windows", nargs="+", metavar=("SOAK.json", "EDGE"),
                        help="print a soak's memory table from its --out file, with the RSS "
                        "trend between the given times (s) and the end, e.g. "
                        "`--windows soak.json 300 3600`; runs nothing")
    args = parser.parse_args(argv)
    if args.agents is None:
        args.agents = {"tasks": 20, "submit": 4, "soak": 8}[args.mode]
    if args.steps_per_run < 4:
        parser.error("--steps-per-run must be at least 4")
    if bad := [pair for pair in args.env if "=" not in pair]:
        parser.error(f"--env takes NAME=VALUE, got {bad[0]!r}")
    return args


def print_windows(path: Path, edges: Sequence[float]) -> None:
    """The memory table of a soak's JSON (`--out`) with trends between `edges`."""
    result = json.loads(path.read_text())
    edges = [*edges, result["samples"][-1]["t"]]
    spans = [f"trend {a:.0f}–{b:.0f} s" for a, b in itertools.pairwise(edges)]
    for key, what in (("rss_mib", "RSS"), ("anon_mib", "anonymous RSS")):
        table = windowed(result["samples"], edges, key)
        if not table:
            continue  # (a soak written before anonymous RSS was sampled)
        print(f"\n{what}, MiB and MiB/h:\n")
        print("| process | " + " | ".join(f"at {e:.0f} s" for e in edges) + " | "
              + " | ".join(spans) + " |")
        print("|---" * (1 + len(edges) + len(spans)) + "|")
        for name, row in table.items():
            print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in row["at_mib"]) + " | "
                  + " | ".join(f"{v:.1f}" for v in row["trend_mib_per_h"]) + " |")


def main() -> None:
    args = parse_args()
    if args.windows:
        print_windows(Path(args.windows[0]), [float(e) for e in args.windows[1:]])
        return
    root = Path(tempfile.mkdtemp(prefix="m27-load-", dir=os.environ.get("M27_BENCH_DIR")))
    result: dict[str, Any] | None = None
    try:
        result = asyncio.run(main_async(args, root))
    finally:
        # A process gone or a failed check: its logs are the evidence, keep them.
        failed = result is None or bool(result.get("died")) or not result.get(
            "check", {}).get("nothing_lost_or_doubled", True)
        if args.keep or failed:
            say(f"kept {root}" + (" (something failed: its logs are the evidence)"
                                  if failed and not args.keep else ""))
        else:
            shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    result.pop("samples", None)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_result(result)


if __name__ == "__main__":
    main()
