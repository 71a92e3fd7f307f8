"""A clustered NATS under chaos, measured: `m27 up --nats-cluster 3 --nodes 2` (R3 streams
and buckets, services and agents spread over the servers), then round after round: submit
pipelines, SIGKILL one NATS server while they run — by turns the JetStream meta leader,
the leader of M27_EVENTS, the leader of KV_m27_nodes (the agents' leases), the server
node-agent-1 is connected to, the leader of M27_COMMANDS (start commands) and the leader of
KV_m27_runs (the orchestrator's changes and outboxes) —, wait for the runs, start the
server again (`m27 up`) and wait until it has caught up.

Per round: which roles the killed server had, how long acknowledged writes to an R3 probe
stream stalled, how long until every stream had a leader again, how long the round's runs
took after the kill, whether every run succeeded, steps that needed a second attempt
(e.g. a node that fenced itself), attempts of one step that overlapped in time (from the
steps' own marks), agents' self-fencings, how long the restarted server took to catch up,
and acknowledged probe writes that were lost.

    python bench/nats_cluster_chaos.py [--rounds 8] [--runs 4] [--heartbeat 5s] [--json]

--heartbeat is the agents' lease renewal ([node] heartbeat_interval; self-fencing stays at
its default 10 s): 5 s is the default, 1 s renews often enough to ride out an election.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from m27.client import Client
from m27.common.bus import NatsBus, topology_names
from m27.common.logging import configure
from m27.embedded.nats_server import nats_server_version
from tests.nats_cluster_support import (  # the same harness the test uses
    PIPELINE,
    PROBE_STREAM,
    Clustered,
    Probe,
    clustered,
    finished,
    leader,
    marks,
    meta_leader,
    overlapping,
    replicas_current,
)

KINDS = ("meta-leader", "events-leader", "leases-leader", "agent-server", "commands-leader",
         "runs-leader")
#: A run not ended this long after the kill is counted as stuck (and cancelled).
STUCK_AFTER_S = 90.0
WATCHED = ("M27_EVENTS", "M27_COMMANDS", "KV_m27_runs", "KV_m27_nodes", "KV_m27_fences",
           PROBE_STREAM)


async def victim_of(kind: str, cluster: Clustered, bus: NatsBus) -> int:
    if kind == "meta-leader":
        return cluster.server_index(meta_leader(cluster))
    if kind == "events-leader":
        return cluster.server_index(await leader(bus, "M27_EVENTS"))
    if kind == "leases-leader":
        return cluster.server_index(await leader(bus, "KV_m27_nodes"))
    if kind == "commands-leader":  # a start command published during its election
        return cluster.server_index(await leader(bus, "M27_COMMANDS"))
    if kind == "runs-leader":  # an orchestrator change stored, its outbox not yet out
        return cluster.server_index(await leader(bus, "KV_m27_runs"))
    agent = next(p for p in cluster.state.processes if p.name == "node-agent-1")
    first = first_server(agent.pid)
    return next(i for i, n in enumerate(cluster.state.nats_servers) if n.url == first)


def first_server(pid: int) -> str:
    """The server a service tries first: the head of its --nats list."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(b"--nats") + 1].split(b",")[0].decode()


async def roles(cluster: Clustered, bus: NatsBus, victim: int) -> list[str]:
    name = f"m27-embedded-{victim + 1}"
    found = ["meta"] if meta_leader(cluster) == name else []
    for stream in WATCHED:
        if await leader(bus, stream) == name:
            found.append(stream)
    return found


async def all_led(bus: NatsBus, dead: str, timeout: float = 60.0) -> None:
    """Until every stream has a leader that is not the dead server (asked with a short
    timeout: a request nobody answers during an election waits that long)."""
    deadline = time.monotonic() + timeout
    js = bus.nc.jetstream(timeout=0.5)
    for stream in (*topology_names(), PROBE_STREAM):
        while True:
            try:
                info = await js.stream_info(stream)
                if info.cluster and info.cluster.leader and info.cluster.leader != dead:
                    break
            except Exception:  # noqa: S110 - no leader yet: ask again
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{stream} has no leader {timeout:.0f}s after the kill")
            await asyncio.sleep(0.05)


def fencings(cluster: Clustered) -> tuple[int, int]:
    """(self-fencings, tasks they killed) in the agents' logs so far."""
    times = killed = 0
    for proc in cluster.state.processes:
        if not proc.name.startswith("node-agent"):
            continue
        for line in Path(proc.log_path).read_text(errors="replace").splitlines():
            if '"node.self_fenced"' in line:
                times += 1
                killed += int(json.loads(line).get("tasks", 0))
    return times, killed


async def one_round(cluster: Clustered, bus: NatsBus, probe: Probe, kind: str,
                    runs: int, work: Path) -> dict[str, Any]:
    fenced_before = fencings(cluster)
    stalls_before = len(probe.stalls)
    async with Client(cluster.state.api, access=cluster.access) as client:
        ids = [await client.submit(PIPELINE, workdir=str(work), no_cache=True)
               for _ in range(runs)]
        deadline = time.monotonic() + 60
        while not any(s.state == "running" for s in (await client.get_run(ids[0])).steps):
            assert time.monotonic() < deadline, "no step of the round's first run started"
            await asyncio.sleep(0.05)
        victim = await victim_of(kind, cluster, bus)
        had = await roles(cluster, bus, victim)
        killed_wall = time.time()
        killed_at = cluster.kill(victim)
        await all_led(bus, f"m27-embedded-{victim + 1}")
        led_after = time.monotonic() - killed_at
        done, stuck = [], []
        for run_id in ids:
            try:
                done.append(await finished(client, run_id, timeout=STUCK_AFTER_S))
            except AssertionError:  # it will not end by itself: say so, clear it away
                stuck.append(run_id)
                await client.cancel(run_id, "stuck after a NATS server was killed")
        # of the runs that ended, by their own end times
        runs_after = max((r.ended_at or killed_wall for r in done), default=killed_wall) \
            - killed_wall
    revived_at = time.monotonic()
    cluster.revive()
    await replicas_current(bus, (*topology_names(), PROBE_STREAM), timeout=120)
    caught_up = time.monotonic() - revived_at
    stalls = probe.stalls[stalls_before:]
    return {"kind": kind, "victim": f"nats-server-{victim + 1}", "roles": had,
            "probe_stall_s": round(max(stalls, default=0.0), 2),
            "leaders_after_s": round(led_after, 2), "runs_done_after_s": round(runs_after, 2),
            "runs": len(ids), "succeeded": sum(r.state == "succeeded" for r in done),
            "stuck": stuck,
            "retried_steps": sum(s.attempt > 1 for r in done for s in r.steps),
            "self_fencings": fencings(cluster)[0] - fenced_before[0],
            "fenced_tasks": fencings(cluster)[1] - fenced_before[1],
            "caught_up_s": round(caught_up, 2), "run_ids": ids}


def summary(rows: list[dict[str, Any]], lost: int, overlaps: int, acked: int) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float]:
        values = [float(r[key]) for r in rows]
        return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2)}

    return {"rounds": len(rows), "runs": sum(r["runs"] for r in rows),
            "succeeded": sum(r["succeeded"] for r in rows),
            "stuck_runs": sum(len(r["stuck"]) for r in rows),
            "retried_steps": sum(r["retried_steps"] for r in rows),
            "self_fencings": sum(r["self_fencings"] for r in rows),
            "fenced_tasks": sum(r["fenced_tasks"] for r in rows),
            "probe_stall_s": stats("probe_stall_s"), "leaders_after_s": stats("leaders_after_s"),
            "runs_done_after_s": stats("runs_done_after_s"), "caught_up_s": stats("caught_up_s"),
            "acked_probe_writes": acked, "acked_writes_lost": lost,
            "overlapping_attempts": overlaps}


async def bench(cluster: Clustered, rounds: int, runs: int, work: Path) -> dict[str, Any]:
    bus = await cluster.admin()
    probe = Probe(bus)
    await probe.start()
    rows = []
    try:
        for i in range(rounds):
            row = await one_round(cluster, bus, probe, KINDS[i % len(KINDS)], runs, work)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "run_ids"}),
                  file=sys.stderr, flush=True)
        await probe.stop()
        lost = len(await probe.lost())
        overlaps = len(overlapping(marks(work)))
        return {"summary": summary(rows, lost, overlaps, len(probe.acked)), "rounds": rows}
    finally:
        await probe.stop()
        await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--runs", type=int, default=4, help="pipelines per round (3 steps)")
    parser.add_argument("--heartbeat", default="5s", help="[node] heartbeat_interval")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", metavar="DIR", type=Path,
                        help="run in DIR and keep it (logs, stores; default: a temporary "
                        "directory, deleted)")
    args = parser.parse_args()
    configure("bench", "warning", stream=sys.stderr)  # stdout is the result
    with contextlib.ExitStack() as stack:
        root = args.keep or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="m27-nats-chaos-")))
        work = root / "work"
        work.mkdir(parents=True)
        env = {"M27_NODE_HEARTBEAT_INTERVAL": args.heartbeat}
        with clustered(root, env=env, log_level="info") as cluster:
            result = asyncio.run(bench(cluster, args.rounds, args.runs, work))
    result["machine"] = {"python": platform.python_version(), "cores": _cores(),
                         "nats_server": nats_server_version(), "heartbeat": args.heartbeat}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(json.dumps(result["summary"], indent=2))


def _cores() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
