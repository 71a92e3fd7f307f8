"""`m27 up`, `down`, `status`, `dashboard` and `demo`: the embedded system on this machine."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Final
from urllib.parse import quote

import nats.errors

from m27.cli import _watch, _windows
from m27.cli._common import Subparsers, add, config, with_client
from m27.client import Client
from m27.common import subjects
from m27.common.api_auth import default_access
from m27.common.bus import connect
from m27.common.config import NatsSection
from m27.common.errors import M27Error
from m27.common.principals import principal
from m27.embedded import system
from m27.embedded.restarts import duration
from m27.telegram import configured as bot_configured

REPORT_WAIT_S: Final = 20.0


def add_commands(sub: Subparsers) -> None:
    up = add(sub, "up", "start nats-server and every service on this machine, in the "
             "background under a supervisor that restarts what exits, and return once all "
             "are ready (again: start what is down, or nothing)", cmd_up)
    up.add_argument("--nodes", type=int, default=1,
                    help="node-agents to start (several let you try failover on one machine)")
    up.add_argument("--gpus", metavar="SPEC",
                    help="GPUs of each node-agent: auto (NVML), none, sim:N, sim:NxMEM "
                    "(default: the real GPUs if NVML finds any, else sim:2 — simulated)")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="run NATS as a JetStream cluster of N servers on this machine (3 "
                    "or 5; streams and buckets get 3 replicas, the services spread over the "
                    "servers and fail over when one dies, which is started again). "
                    "Its store is $M27_HOME/nats-cluster, apart from the one server's "
                    "(default: 1, one server)")
    add(sub, "down", "stop every process `m27 up` started (runs are kept)", cmd_down)
    status = add(sub, "status", "show what runs on this machine: each process, its "
                 "restarts and last exit, and what crash-loops", cmd_status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    board = add(sub, "dashboard", "print the live dashboard's address as a link that signs "
                "you in with your API token (keep it to yourself: it carries the token)",
                cmd_dashboard)
    board.add_argument("--url", metavar="URL",
                       help="the dashboard's address (default: the embedded system's)")
    demo = add(sub, "demo", "bring the system up if needed and run the bundled demo "
               "pipeline (CPU prep → GPU training → GPU-light analysis) to a report", cmd_demo)
    demo.add_argument("--epochs", type=int, default=15,
                      help="training epochs of the demo's GPU step (default: 15)")
    demo.add_argument("--spike-epoch", type=int, default=0, metavar="N",
                      help="make the training step blunder at the start of epoch N (a "
                      "learning rate 300x too large for one batch), to see its training "
                      "monitor publish training_anomaly and ask for a checkpoint (default: "
                      "0, none)")
    demo.add_argument("--down", action="store_true",
                      help="stop the system afterwards if the demo started it (default: "
                      "leave it running, to look at the run with m27 show, logs, queue)")


def cmd_up(args: argparse.Namespace) -> int:
    home = args.home
    print(f"starting m27 under {home} …", file=sys.stderr, flush=True)
    cfg = config(args)
    before = system.read_state(home)
    down = {row.name for row in system.statuses(before)
            if not (row.alive and row.state == "running")} if before else set()
    state, started = system.up(home, nodes=args.nodes, gpus=args.gpus, config=cfg.nats,
                               telegram=bot_configured(cfg.telegram),
                               nats_cluster=args.nats_cluster, policy=cfg.supervisor)
    if not started and down:
        print(revived_note(sorted(down)))
    elif not started and len(state.nats_servers or [0]) != args.nats_cluster:
        print(f"m27: already running with {len(state.nats_servers or [0])} NATS server(s); "
              "`m27 down` first to change --nats-cluster", file=sys.stderr)
    if not started and (admitted := system.admit_nodes(home)):
        print(f"admitted node(s) {', '.join(admitted)} to the bus (their seeds are in "
              f"{system.credentials_dir(home)}): each may now join with `m27 agent`")
    print_up(state, started)
    return 0


def revived_note(names: list[str]) -> str:
    """What `m27 up` says when the supervisor started what was down again at its asking."""
    note = f"started {', '.join(names)} again"
    if any(name.startswith("nats-server-") for name in names):
        note += ": a NATS server rejoins the cluster and catches up from the others"
    return note


def print_up(state: system.EmbeddedState, started: bool) -> None:
    verb = "started" if started else "already running"
    gpus = f"{state.gpus} (simulated GPUs: no NVIDIA GPU found)" if state.simulated_gpus \
        else state.gpus
    print(f"m27 {verb}: api {state.api}, nats {nats_summary(state)}, "
          f"{sum(p.name.startswith('node-agent') for p in state.processes)} node(s), "
          f"GPUs {gpus}")
    if url := system.dashboard_url(state):
        print(f"dashboard {url} (`m27 dashboard` prints a link that signs you in)")


def nats_summary(state: system.EmbeddedState) -> str:
    """The bus in a line: its URL, or a cluster's size and replicas (each server is a row
    of `m27 status`)."""
    if not state.nats_servers:
        return state.nats_url
    return (f"cluster of {len(state.nats_servers)} servers ({system.CLUSTER_REPLICAS} "
            f"replicas) {state.nats_url}")


def cmd_dashboard(args: argparse.Namespace) -> int:
    url = args.url
    if not url:
        state = system.read_state(args.home)
        url = system.dashboard_url(state) if state else ""
        if not url:
            raise M27Error(f"no dashboard runs under {args.home}: start the system with "
                           "`m27 up` ([report] dashboard must not be empty), or pass --url")
    token = default_access().token
    if not isinstance(token, str):
        raise M27Error("this client signs its tokens per call; pass a token in $M27_TOKEN")
    print(f"{url.rstrip('/')}/?token={quote(token, safe='')}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state = system.down(args.home)
    print("m27 stopped" if state else "m27 was not running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = system.read_state(args.home)
    if state is None:
        if args.json:
            print(json.dumps({"up": False, "home": str(args.home), "processes": []}))
        else:
            print(f"m27 is not running (home {args.home}); start it with `m27 up`")
        return 1
    dead = dead_letters(state, config(args).nats)
    if args.json:
        print(system.status_json(state, dead))
        return 0
    print(f"m27 under {state.home}: api {state.api}, nats {nats_summary(state)}, "
          f"GPUs {state.gpus}"
          + (" (simulated)" if state.simulated_gpus else ""))
    if url := system.dashboard_url(state):
        print(f"  dashboard {url}")
    rows = system.statuses(state)
    now = time.time()
    for row in rows:
        print(status_line(row, now))
    if not system.supervised(state):
        print(f"  the supervisor (pid {state.supervisor_pid}) is not running: nothing "
              "restarts what exits; `m27 up` starts everything afresh")
    elif any(row.crash_looping for row in rows):
        print("  `m27 up` starts what the supervisor gave up on again (see why it exits in "
              "its log first)")
    if dead:
        print(f"  {dead} dead letter(s): messages a service rejected or kept failing on, kept "
              f"with the reason in stream {subjects.DEAD_STREAM} ({subjects.DEAD_ALL}); the "
              "services' logs say more (bus.message_rejected, bus.message_dead_lettered)")
    from m27.cli._queue import maintenance_states

    for node_id, held in sorted(maintenance_states(args).items()):
        print(f"  node {node_id} is {held} (`m27 node uncordon {node_id}` returns it)")
    for line in platform_warnings(args):
        print(line)
    for line in window_notes(args):
        print(line)
    return 0 if system.is_up(state) else 1


def window_notes(args: argparse.Namespace) -> list[str]:
    """Maintenance windows under way, near, or whose last run failed (none when the
    scheduler cannot be reached)."""
    from m27.cli._queue import with_scheduler

    try:
        windows = with_scheduler(args, lambda c: c.windows())
    except M27Error:
        return []
    return _windows.status_notes(windows, time.time())


def platform_warnings(args: argparse.Namespace) -> list[str]:
    """Nodes whose driver or CUDA differs from most live nodes' (none when the API cannot
    be reached: the rest of `m27 status` does not depend on it)."""
    try:
        nodes = with_client(args, lambda c: c.list_nodes())
    except M27Error:
        return []
    return [f"  WARNING node {n.node_id} differs from most nodes: "
            f"{'; '.join(n.platform_differences)} (a lab's nodes should run one driver and "
            "one CUDA version)" for n in nodes if n.platform_differences]


def status_line(row: system.ProcessStatus, now: float) -> str:
    """One process of `m27 status`: up or DOWN, where, and how its supervision went."""
    mark = "up  " if row.alive else "DOWN"
    line = f"  {mark} {row.name:<18} pid {row.pid:<8} {row.grpc_address or row.nats_url}"
    note = supervision_note(row, now)
    return f"{line}  {note}" if note else line


def supervision_note(row: system.ProcessStatus, now: float) -> str:
    """`restarts 2, last exit: SIGKILL at 14:02:11`, led by what is happening to it unless
    it just runs; a crash-looping one says so in capitals, with its log."""
    when = time.strftime("%H:%M:%S", time.localtime(row.last_exit_at))
    last = f"last exit: {row.last_exit} at {when}" if row.last_exit else ""
    if row.crash_looping:
        return f"CRASH-LOOPING: {row.reason}; {last}; its log {row.log_path}"
    history = ", ".join(part for part in (f"restarts {row.restarts}" if row.restarts else "",
                                          last) if part)
    lead = {"restarting": f"restarting in {duration(max(0.0, row.restart_at - now))}",
            "starting": "starting again", "stopped": "stopped",
            "dead": "dead, and nothing restarts it"}.get(row.state, "")
    if lead and history:
        return f"{lead} ({history})"
    return lead or history


def dead_letters(state: system.EmbeddedState, settings: NatsSection) -> int | None:
    """Messages in the dead-letter stream; None when NATS cannot be asked."""
    who = system.access(Path(state.home), principal("status"), settings)

    async def count() -> int:
        nc = await connect(state.nats_url, name="m27-cli-status", timeout=3.0, access=who)
        try:
            info = await nc.jetstream(timeout=3.0).stream_info(subjects.DEAD_STREAM)
            return int(info.state.messages)
        finally:
            await nc.close()

    try:
        return asyncio.run(count())
    except (M27Error, OSError, TimeoutError, nats.errors.Error):
        return None


def cmd_demo(args: argparse.Namespace) -> int:
    from m27.demo import demo_pipeline

    home = args.home
    cfg = config(args)
    state, started = system.up(home, config=cfg.nats, telegram=bot_configured(cfg.telegram),
                               policy=cfg.supervisor)
    print_up(state, started)
    workdir = home / "demo" / time.strftime("%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True, exist_ok=True)
    text, variables = demo_pipeline(epochs=args.epochs, spike_epoch=args.spike_epoch)

    async def work(client: Client) -> int:
        run_id = await client.submit(text, vars=variables, workdir=str(workdir),
                                     source_name="m27-demo.yaml")
        print(f"demo run {run_id} (working in {workdir})", flush=True)
        run = await _watch.watch(client, run_id)
        report = run.report_path or await _wait_for_report(client, run_id)
        _watch.print_outcome(run, report)
        if not report:
            print("m27: the report service wrote no report in time; see `m27 status`",
                  file=sys.stderr)
            return 1
        print(f"its curves as tables and figures: m27 compare {run_id} -o {workdir}/compare;"
              " the cluster live: m27 dashboard", file=sys.stderr)
        return _watch.exit_code_for(run)

    args.api = state.api
    try:
        return with_client(args, work)
    finally:
        stopped = bool(args.down and started and system.down(home))
        print(closing_note(state, started=started, stopped=stopped), file=sys.stderr)


def closing_note(state: system.EmbeddedState, *, started: bool, stopped: bool) -> str:
    """What the demo leaves running, and how to stop it."""
    if stopped:
        return "m27: stopped the system the demo started (--down)"
    servers = [n.name for n in state.nats_servers] or ["nats-server"]
    names = ", ".join([*servers, *(p.name for p in state.processes)])
    why = "the demo started it" if started else "it was running before the demo"
    return (f"m27 is still running under {state.home} ({why}): {names}. `m27 status` "
            "shows it, `m27 down` stops it" + ("; `m27 demo --down` stops what the demo "
                                              "started" if started else ""))


async def _wait_for_report(client: Client, run_id: str) -> str:
    deadline = time.monotonic() + REPORT_WAIT_S
    while time.monotonic() < deadline:
        run = await client.get_run(run_id)
        if run.report_path:
            return run.report_path
        await asyncio.sleep(0.25)
    return ""
