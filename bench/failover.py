"""Failover, measured: kill -9 the node-agent running a step, N times, with the default
leases (renewal every 5 s, self-fencing after 10 s, node lost after 15 s).

Per trial: time from the kill to the scheduler declaring the node lost, and to the step
running again elsewhere (its `task_started` of attempt 2); work lost (time since the step's
last checkpoint when it was killed, i.e. computation redone); and whether two attempts ever
ran at once (from the times the step itself writes). Afterwards, the CPU an agent uses at
5 s sampling while it runs a step.

    python bench/failover.py [--trials 20] [--checkpoint-every 5] [--json]

The step is a Python loop that checkpoints a counter every --checkpoint-every seconds; the
nodes have simulated GPUs (this is about the control plane, not GPU work).
"""

from __future__ import annotations

import argparse
import asyncio
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
        self.changed = asyncio.Event()

    async def on_event(self, msg: Any) -> None:
        event = events.decode_event(msg.data)
        if isinstance(event, events.NodeLost):
            self.lost_at.setdefault(event.node_id, time.time())
        elif isinstance(event, events.TaskStarted):
            self.started.setdefault((event.run_id, event.attempt), event.at)
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
    try:
        agents = {n: cluster.launch(f"agent-{n}", "m27.node_agent", agent_args(n))
                  for n in ("a", "b")}
        wait_ready(list(agents.values()))
        trials = Trials(cluster, work, args.checkpoint_every)
        bus = await NatsBus.open(cluster.nats_url, name="bench")
        await bus.nc.subscribe(subjects.EVENTS_ALL, cb=trials.on_event)
        results = []
        async with Client(cluster.api) as client:
            for number in range(args.trials):
                results.append(await trials.one(client, agents))
                print(f"trial {number + 1}: {results[-1]}", file=sys.stderr, flush=True)
            cpu = await agent_cpu(cluster, client, work, agents["a"], args.cpu_seconds)
        await bus.close()
    finally:
        cluster.stop()
    return summarize(results, cpu, args)


def summarize(results: list[dict[str, float]], cpu: float,
              args: argparse.Namespace) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float]:
        values = [r[key] for r in results]
        return {"p50": statistics.median(values), "p95": percentile(values, 0.95),
                "max": max(values)}

    return {"trials": len(results), "checkpoint_every_s": args.checkpoint_every,
            "machine": platform.platform(), "cpus": os.cpu_count(),
            "detect_s": stats("detect_s"), "replaced_s": stats("replaced_s"),
            "lost_work_s": stats("lost_work_s"),
            "overlapping_attempts": int(sum(r["overlap"] for r in results)),
            "agent_cpu_pct_at_5s_sampling": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--checkpoint-every", type=float, default=5.0)
    parser.add_argument("--cpu-seconds", type=float, default=60.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="m27-failover-") as tmp:
        result = asyncio.run(main_async(args, Path(tmp)))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for key in ("detect_s", "replaced_s", "lost_work_s"):
        s = result[key]
        print(f"{key:<12} p50 {s['p50']:6.2f}  p95 {s['p95']:6.2f}  max {s['max']:6.2f}")
    print(f"overlapping attempts: {result['overlapping_attempts']} of {result['trials']}")
    print(f"agent CPU at 5 s sampling: {result['agent_cpu_pct_at_5s_sampling']:.2f} %")


if __name__ == "__main__":
    main()
