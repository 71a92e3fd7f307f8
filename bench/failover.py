"""Failover, measured: kill -9 the node-agent running a step, N times, with the default
leases (renewal every 5 s, self-fencing after 10 s, node lost after 15 s).

`--mode counter` (the default): the step is a Python loop that checkpoints a counter every
--checkpoint-every seconds; the nodes have simulated GPUs (this is about the control plane,
not GPU work). Per trial: time from the kill to the scheduler declaring the node lost, and
to the step running again elsewhere (its `task_started` of attempt 2); work lost (time
since the step's last checkpoint when it was killed, i.e. computation redone); and whether
two attempts ever ran at once (from the times the step itself writes). Afterwards, the CPU
an agent uses at 5 s sampling while it runs a step.

    python bench/failover.py [--trials 20] [--checkpoint-every 5] [--json]

`--mode train`: the step trains with `m27.train.Checkpointer` (no arguments but the model,
optimizer and `every_seconds`: it finds the checkpoint-store the node-agent names in
M27_CHECKPOINT_STORE) a stack of Linear(1024, 1024) layers with AdamW, --state-gib of
state in all (parameters + the two AdamW moments, 12 bytes per parameter: 1 GiB is ~89.5M
parameters, 85 layers), checkpointing every --checkpoint-every seconds. A step is
GPU-like: preallocated gradients, a sleep of --step-seconds for forward/backward, the
AdamW step on the CPU (one torch thread). The program writes marker lines with wall-clock
times: started, model built, resume() returned (restored step and how long it took),
first step after resume done, each checkpoint started and each durable. A trial waits
until attempt 1 has a durable checkpoint, then kills: `--kill node` (the default) kills
-9 the node-agent and the step's process group, as when the machine dies; `--kill agent`
kills -9 only the agent (the orphaned step then runs on beside the new attempt, competing
for the CPU, until the restarted agent reaps it; until attempt 2 starts its checkpoints
still count, so "work lost" can be negative). Per trial, from the kill: node lost,
attempt 2 started (`task_started`), its program started, imported torch, built its model,
restore finished, first step done; and the restore itself (resume(): every chunk read
from the checkpoint-store over gRPC and its sha256 verified), the first step after it,
the work lost (kill − when the restored step was saved), the state size.

    python bench/failover.py --mode train [--trials 3] [--state-gib 1] [--checkpoint-every 5]
        [--step-seconds 0.1] [--kill node|agent] [--json]

Each run starts its own system (tests.support.Cluster: nats-server and the five services
on loopback) with two node-agents, each with an M27_HOME of its own (train mode) so a
restore can only come from the checkpoint-store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from m27.client import Client
from m27.common import events, subjects
from m27.common.bus import NatsBus
from m27.embedded.processes import ServiceProcess, wait_ready

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support import Cluster  # the same helper the tests use

WORKER = '''\
import json, os, pathlib, sys, time
state = pathlib.Path(os.environ["M27_CHECKPOINT_DIR"]) / "state.json"
saved = json.loads(state.read_text()) if state.exists() else {"i": 0}
attempt, every = os.environ["M27_ATTEMPT"], float(sys.argv[2])
last = time.time()
with open(f"alive-{os.environ['M27_RUN_ID']}.log", "a") as alive:
    for i in range(saved["i"], int(sys.argv[1])):
        alive.write(f"{attempt} {time.time():.3f}\\n"); alive.flush()
        time.sleep(0.1)
        if time.time() - last >= every:
            last = time.time()
            tmp = state.with_suffix(".tmp")
            tmp.write_text(json.dumps({"i": i + 1, "at": last}))
            os.replace(tmp, state)
'''

TRAIN_WORKER = '''\
import os, sys, time
t0 = time.time()
import torch
from m27.train import Checkpointer, Cursor

attempt = os.environ["M27_ATTEMPT"]
marks = open(f"marks-{os.environ['M27_RUN_ID']}.log", "a", buffering=1)

def mark(what, at, *values):
    marks.write(" ".join([what, attempt, f"{at:.3f}", *map(str, values)]) + "\\n")

mark("started", t0)
mark("imported", time.time())
state_gib, every, step_s = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(1)  # a GPU job's host side; the rest is the persist threads'
width = 1024
layers = max(1, round(state_gib * 2**30 / 12 / (width * width + width)))
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
ckpt = Checkpointer(model=model, optimizer=optimizer, every_seconds=every, stop_signal=False)
params = sum(p.numel() for p in model.parameters())
mark("built", time.time(), params, 12 * params)
began = time.perf_counter()
cursor = ckpt.resume()
mark("resumed", time.time(), -1 if cursor is None else cursor.step,
     f"{time.perf_counter() - began:.3f}")
cursor = cursor or Cursor()
durable = cursor.step
first = True
while True:
    for parameter, grad in zip(model.parameters(), grads):
        parameter.grad = grad
    time.sleep(step_s)  # forward + backward on a GPU
    optimizer.step()
    cursor.advance()
    if first:
        mark("first", time.time(), cursor.step)
        first = False
    if ckpt.after_step(cursor):
        mark("saved", time.time(), cursor.step)
    latest = ckpt.latest
    if latest is not None and latest.step != durable:
        durable = latest.step
        report = next((r for r in reversed(ckpt.reports) if r.step == durable), None)
        mark("durable", time.time(), durable,
             f"{report.durable_s:.3f}" if report and report.durable_s else "nan")
'''


def agent_args(node: str) -> list[str]:
    return ["--node-id", node, "--instance", node, "--gpus", "sim:1"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Trials:
    def __init__(self, cluster: Cluster, work: Path, every: float) -> None:
        self.cluster = cluster
        self.work = work
        self.every = every
        self.lost_at: dict[str, float] = {}
        self.started: dict[tuple[str, int], float] = {}
        self.pids: dict[tuple[str, int], int] = {}
        self.changed = asyncio.Event()

    async def on_event(self, msg: Any) -> None:
        event = events.decode_event(msg.data)
        if isinstance(event, events.NodeLost):
            self.lost_at.setdefault(event.node_id, time.time())
        elif isinstance(event, events.TaskStarted):
            self.started.setdefault((event.run_id, event.attempt), event.at)
            self.pids.setdefault((event.run_id, event.attempt), event.pid)
            self.changed.set()

    async def one(self, client: Client, agents: dict[str, ServiceProcess]) -> dict[str, float]:
        run_id = await client.submit(
            "pipeline:\n  - {name: s, type: gpu, command: '\"$M27_PYTHON\" worker.py "
            f"100000 {self.every}'}}\n", workdir=str(self.work))
        node = await self._running_node(client, run_id)
        await asyncio.sleep(self.every * 1.5)  # let it checkpoint at least once
        self.lost_at.pop(node, None)
        checkpoint = self._checkpoint_at(run_id)
        killed = time.time()
        os.kill(agents[node].pid, signal.SIGKILL)
        while (run_id, 2) not in self.started:
            self.changed.clear()
            await self.changed.wait()
        await client.cancel(run_id, "trial over")
        result = self._measure(run_id, node, killed, checkpoint)
        agents[node] = self._restart(node)
        return result

    async def _running_node(self, client: Client, run_id: str) -> str:
        while True:
            step = (await client.get_run(run_id)).steps[0]
            if step.state == "running" and step.node_id:
                return step.node_id
            await asyncio.sleep(0.05)

    def _checkpoint_at(self, run_id: str) -> float:
        path = self.cluster.home / "runs" / run_id / "checkpoints" / "s" / "state.json"
        return float(json.loads(path.read_text())["at"])

    def _measure(self, run_id: str, node: str, killed: float,
                 checkpoint: float) -> dict[str, float]:
        spans: dict[str, list[float]] = {}
        for line in (self.work / f"alive-{run_id}.log").read_text().splitlines():
            attempt, stamp = line.split()
            spans.setdefault(attempt, []).append(float(stamp))
        overlap = "2" in spans and max(spans["1"]) >= min(spans["2"])
        return {"detect_s": self.lost_at.get(node, float("nan")) - killed,
                "replaced_s": self.started[(run_id, 2)] - killed,
                "lost_work_s": killed - checkpoint,
                "overlap": float(overlap)}

    def _restart(self, node: str) -> ServiceProcess:
        proc = self.cluster.launch(f"agent-{node}", "m27.node_agent", agent_args(node))
        wait_ready([proc])
        return proc


class TrainTrials(Trials):
    """`--mode train`: a step checkpointing --state-gib with m27.train, killed with its
    node once a checkpoint is durable; times from its marker lines."""

    def __init__(self, cluster: Cluster, work: Path, args: argparse.Namespace) -> None:
        super().__init__(cluster, work, args.checkpoint_every)
        self.args = args

    async def one(self, client: Client, agents: dict[str, ServiceProcess]) -> dict[str, float]:
        args = self.args
        run_id = await client.submit(
            "pipeline:\n  - {name: s, type: gpu, command: '\"$M27_PYTHON\" train_worker.py "
            f"{args.state_gib} {args.checkpoint_every} {args.step_seconds}'}}\n",
            workdir=str(self.work))
        node = await self._running_node(client, run_id)
        marks = self.work / f"marks-{run_id}.log"
        deadline = time.monotonic() + args.wait_durable
        while not any(m["what"] == "durable" for m in read_marks(marks, "1")):
            if time.monotonic() > deadline:
                home = self.cluster.root / f"home-{node}"
                raise RuntimeError(f"no checkpoint durable after {args.wait_durable:.0f} s; "
                                   f"the step's output is under {home}")
            await asyncio.sleep(0.1)
        self.lost_at.pop(node, None)
        killed = time.time()
        os.kill(agents[node].pid, signal.SIGKILL)
        if args.kill == "node":  # the machine is gone: its step with it
            group = self.pids.get((run_id, 1))
            if group is None:
                raise RuntimeError("no task_started of attempt 1 was seen: its pid is unknown")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)  # the step runs in a session of its own
        deadline = time.monotonic() + args.wait_durable + 120
        while not any(m["what"] == "first" for m in read_marks(marks, "2")):
            if time.monotonic() > deadline:
                raise RuntimeError("attempt 2 did not run a step in time")
            await asyncio.sleep(0.1)
        await client.cancel(run_id, "trial over")
        result = self._measure_train(run_id, node, killed, marks)
        agents[node] = self._restart(node)
        await self._finished(client, run_id)
        return result

    def _measure_train(self, run_id: str, node: str, killed: float,
                       marks: Path) -> dict[str, float]:
        # attempt 1: the last of each mark before the kill; attempt 2: the first of each
        first = {m["what"]: m for m in read_marks(marks, "1") if m["at"] <= killed}
        second = {m["what"]: m for m in read_marks(marks, "2")[::-1]}
        resumed = second["resumed"]
        restored_step = int(resumed["values"][0])
        saved_at = [m["at"] for m in read_marks(marks, "1")
                    if m["what"] == "saved" and int(m["values"][0]) == restored_step]
        return {
            "detect_s": self.lost_at.get(node, float("nan")) - killed,
            "replaced_s": self.started[(run_id, 2)] - killed,
            "program_started_s": second["started"]["at"] - killed,
            "imported_s": second["imported"]["at"] - killed,
            "model_built_s": second["built"]["at"] - killed,
            "restored_s": resumed["at"] - killed,
            "first_step_s": second["first"]["at"] - killed,
            "restore_s": float(resumed["values"][1]),
            "first_step_after_restore_s": second["first"]["at"] - resumed["at"],
            "lost_work_s": killed - saved_at[0] if saved_at else float("nan"),
            "restored_step": restored_step,
            "last_durable_step": int(first["durable"]["values"][0]),
            "durable_before_kill_s": float(first["durable"]["values"][1]),
            "state_bytes": int(second["built"]["values"][1]),
        }

    def _restart(self, node: str) -> ServiceProcess:
        proc = start_agent(self.cluster, node)
        wait_ready([proc])
        return proc

    async def _finished(self, client: Client, run_id: str, timeout: float = 120.0) -> None:
        """Wait for the cancelled run to end, so its processes leave the CPU."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (await client.get_run(run_id)).state in {"succeeded", "failed", "cancelled"}:
                return
            await asyncio.sleep(0.2)


def read_marks(path: Path, attempt: str) -> list[dict[str, Any]]:
    """The train worker's marker lines of one attempt: what, when (wall clock), values."""
    found: list[dict[str, Any]] = []
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1] == attempt:
            found.append({"what": fields[0], "at": float(fields[2]), "values": fields[3:]})
    return found


def start_agent(cluster: Cluster, node: str) -> ServiceProcess:
    """An agent with a home of its own, as on a machine of its own: its checkpoint
    directories are not the other's, so a restore comes from the checkpoint-store."""
    home = cluster.root / f"home-{node}"
    home.mkdir(exist_ok=True)
    return cluster.launch(f"agent-{node}", "m27.node_agent", agent_args(node),
                          env={"M27_HOME": str(home)})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def agent_cpu(cluster: Cluster, client: Client, work: Path, agent: ServiceProcess,
                    seconds: float) -> float:
    """CPU% of an agent running one step, sampling every 5 s (the default)."""
    run_id = await client.submit("pipeline:\n  - {name: idle, type: gpu, command: 'sleep "
                                 f"{seconds + 30:.0f}'}}\n", workdir=str(work))
    await asyncio.sleep(3)
    before, began = cpu_seconds(agent.pid), time.monotonic()
    await asyncio.sleep(seconds)
    used = cpu_seconds(agent.pid) - before
    await client.cancel(run_id, "measured")
    return 100.0 * used / (time.monotonic() - began)


async def main_async(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    cluster = Cluster(root, nodes=0)
    cluster.start()
    work = root / "work"
    work.mkdir()
    (work / "worker.py").write_text(WORKER)
    (work / "train_worker.py").write_text(TRAIN_WORKER)
    load_start = os.getloadavg()
    try:
        trials: Trials
        if args.mode == "train":
            agents = {n: start_agent(cluster, n) for n in ("a", "b")}
            trials = TrainTrials(cluster, work, args)
        else:
            agents = {n: cluster.launch(f"agent-{n}", "m27.node_agent", agent_args(n))
                      for n in ("a", "b")}
            trials = Trials(cluster, work, args.checkpoint_every)
        wait_ready(list(agents.values()))
        bus = await NatsBus.open(cluster.nats_url, name="bench")
        await bus.nc.subscribe(subjects.EVENTS_ALL, cb=trials.on_event)
        results = []
        cpu = float("nan")
        async with cluster.client() as client:
            for number in range(args.trials):
                results.append(await trials.one(client, agents))
                print(f"trial {number + 1}: {results[-1]}", file=sys.stderr, flush=True)
            if args.mode == "counter":
                cpu = await agent_cpu(cluster, client, work, agents["a"], args.cpu_seconds)
        await bus.close()
    finally:
        cluster.stop()
    if args.mode == "train":
        return summarize_train(results, args, load_start)
    return summarize(results, cpu, args)


def stats(results: list[dict[str, float]], key: str) -> dict[str, float]:
    values = [r[key] for r in results]
    return {"p50": statistics.median(values), "p95": percentile(values, 0.95),
            "max": max(values)}


def summarize(results: list[dict[str, float]], cpu: float,
              args: argparse.Namespace) -> dict[str, Any]:
    return {"trials": len(results), "checkpoint_every_s": args.checkpoint_every,
            "machine": platform.platform(), "cpus": os.cpu_count(),
            "detect_s": stats(results, "detect_s"), "replaced_s": stats(results, "replaced_s"),
            "lost_work_s": stats(results, "lost_work_s"),
            "overlapping_attempts": int(sum(r["overlap"] for r in results)),
            "agent_cpu_pct_at_5s_sampling": cpu}


TRAIN_FIGURES = {
    "detect_s": "kill → node lost",
    "replaced_s": "kill → attempt 2 started (task_started)",
    "program_started_s": "kill → its program started",
    "imported_s": "kill → torch and m27.train imported",
    "model_built_s": "kill → model and Checkpointer built",
    "restored_s": "kill → restore finished (resume() returned)",
    "first_step_s": "kill → first step done",
    "restore_s": "restore itself (resume())",
    "first_step_after_restore_s": "first step after restore",
    "lost_work_s": "work lost (kill − when the restored step was saved)",
    "durable_before_kill_s": "last checkpoint before the kill: after_step → durable",
}


def summarize_train(results: list[dict[str, float]], args: argparse.Namespace,
                    load_start: tuple[float, float, float]) -> dict[str, Any]:
    return {"mode": "train", "trials": len(results), "kill": args.kill,
            "checkpoint_every_s": args.checkpoint_every, "step_seconds": args.step_seconds,
            "state_bytes": results[0]["state_bytes"] if results else 0,
            "machine": platform.platform(), "cpus": os.cpu_count(),
            "load_start": list(load_start), "load_end": list(os.getloadavg()),
            "figures": {key: stats(results, key) for key in TRAIN_FIGURES},
            "per_trial": results}


def print_train(result: dict[str, Any]) -> None:
    load = " → ".join(" ".join(f"{v:.2f}" for v in result[k]) for k in ("load_start",
                                                                         "load_end"))
    print(f"machine: {result['machine']}, {result['cpus']} cores; load average {load}")
    print(f"state {result['state_bytes'] / 2**30:.2f} GiB (parameters + AdamW moments), "
          f"a checkpoint every {result['checkpoint_every_s']:g} s, steps of "
          f"{result['step_seconds']:g} s sleep + the AdamW step, kill: {result['kill']}, "
          f"{result['trials']} trials")
    print()
    print("| from the kill | p50 | max | trials |")
    print("|---|---|---|---|")
    for key, label in TRAIN_FIGURES.items():
        figure = result["figures"][key]
        each = ", ".join(f"{r[key]:.2f}" for r in result["per_trial"])
        print(f"| {label} | {figure['p50']:.2f} s | {figure['max']:.2f} s | {each} |")
    steps = ", ".join(f"{r['restored_step']} (last durable seen {r['last_durable_step']})"
                      for r in result["per_trial"])
    print(f"\nrestored steps: {steps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("counter", "train"), default="counter")
    parser.add_argument("--trials", type=int, default=None,
                        help="default: 20 (counter), 3 (train)")
    parser.add_argument("--checkpoint-every", type=float, default=5.0)
    parser.add_argument("--cpu-seconds", type=float, default=60.0, help="counter mode")
    parser.add_argument("--state-gib", type=float, default=1.0, help="train mode")
    parser.add_argument("--step-seconds", type=float, default=0.1,
                        help="train mode: the sleep standing for forward/backward")
    parser.add_argument("--kill", choices=("node", "agent"), default="node",
                        help="train mode: kill the agent and its step (node), or the agent")
    parser.add_argument("--wait-durable", type=float, default=600.0,
                        help="train mode: give up if no checkpoint is durable by then (s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.trials is None:
        args.trials = 3 if args.mode == "train" else 20
    with tempfile.TemporaryDirectory(prefix="m27-failover-",
                                     dir=os.environ.get("M27_BENCH_DIR")) as tmp:
        result = asyncio.run(main_async(args, Path(tmp)))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if args.mode == "train":
        print_train(result)
        return
    for key in ("detect_s", "replaced_s", "lost_work_s"):
        s = result[key]
        print(f"{key:<12} p50 {s['p50']:6.2f}  p95 {s['p95']:6.2f}  max {s['max']:6.2f}")
    print(f"overlapping attempts: {result['overlapping_attempts']} of {result['trials']}")
    print(f"agent CPU at 5 s sampling: {result['agent_cpu_pct_at_5s_sampling']:.2f} %")


if __name__ == "__main__":
    main()
