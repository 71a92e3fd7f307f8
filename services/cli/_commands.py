"""The subcommands of `m27`. Each returns the process exit code."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec

from m27.cli import _watch
from m27.client import Client
from m27.common.config import Config, load_config
from m27.common.errors import M27Error
from m27.common.model import URGENCIES, Urgency
from m27.common.paths import m27_home
from m27.common.units import format_duration
from m27.embedded import system

T = TypeVar("T")
MAX_FILE_BYTES: Final = 1024 * 1024
REPORT_WAIT_S: Final = 20.0


class NotRunningError(M27Error):
    pass


def add_all(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _add_up(sub)
    _add(sub, "down", "stop every process `m27 up` started (runs are kept)", cmd_down)
    status = _add(sub, "status", "show what runs on this machine", cmd_status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _add_submit(sub)
    watch = _add(sub, "watch", "follow a run live; exit 0 if it succeeds", cmd_watch)
    watch.add_argument("run_id", metavar="RUN")
    runs = _add(sub, "runs", "list recent runs", cmd_runs)
    runs.add_argument("--limit", type=int, default=20)
    runs.add_argument("--json", action="store_true")
    show = _add(sub, "show", "show one run with every step", cmd_show)
    show.add_argument("run_id", metavar="RUN")
    show.add_argument("--json", action="store_true")
    cancel = _add(sub, "cancel", "stop a run's running steps and cancel the rest", cmd_cancel)
    cancel.add_argument("run_id", metavar="RUN")
    cancel.add_argument("--reason", default="")
    demo = _add(sub, "demo", "bring the system up if needed and run the bundled demo "
                "pipeline (CPU prep → GPU training → GPU-light analysis) to a report", cmd_demo)
    demo.add_argument("--epochs", type=int, default=15)


def _add(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, text: str,
         handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=text, description=text)
    parser.set_defaults(handler=handler)
    return parser


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = _add(sub, "up", "start nats-server and every service on this machine, in the "
              "background, and return once all are ready", cmd_up)
    up.add_argument("--nodes", type=int, default=1,
                    help="node-agents to start (several let you try failover on one machine)")
    up.add_argument("--gpus", metavar="SPEC",
                    help="GPUs of each node-agent: auto (NVML), none, sim:N, sim:NxMEM "
                    "(default: the real GPUs if NVML finds any, else sim:2 — simulated)")


def _add_submit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    submit = _add(sub, "submit", "submit a pipeline YAML file; prints the run id", cmd_submit)
    submit.add_argument("file", type=Path, metavar="FILE")
    submit.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                        help="fill {{NAME}} in commands (repeatable); values are passed "
                        "to the shell as one quoted word")
    submit.add_argument("--urgency", choices=URGENCIES, default="normal")
    submit.add_argument("--user", default="", help="submit as this user (default: you)")
    submit.add_argument("--workdir", type=Path,
                        help="directory the steps run in (default: the current directory)")
    submit.add_argument("--watch", action="store_true", help="follow the run until it ends")


# ---------------------------------------------------------------- helpers


def _config(args: argparse.Namespace) -> Config:
    return load_config(Path(args.config) if args.config else None).config


def _api(args: argparse.Namespace, config: Config) -> str:
    explicit = args.api or os.environ.get("M27_API") or config.client.api
    if explicit:
        return str(explicit)
    home = m27_home()
    state = system.read_state(home)
    if state is None:
        raise NotRunningError(f"nothing is running under {home}: start the system with "
                              "`m27 up`, or pass --api HOST:PORT / set $M27_API")
    down = [s.name for s in system.statuses(state) if not s.alive]
    if "orchestrator" in down or "nats-server" in down:
        raise NotRunningError(f"the system is only partly running ({', '.join(down)} "
                              "stopped): run `m27 up` to restart it")
    return state.api


def _with_client(args: argparse.Namespace, work: Callable[[Client], Awaitable[T]]) -> T:
    address = _api(args, _config(args))

    async def run() -> T:
        async with Client(address) as client:
            return await work(client)

    return asyncio.run(run())


def _parse_vars(pairs: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise M27Error(f"--var expects NAME=VALUE, got {pair!r}")
        result[name] = value
    return result


def _read_pipeline(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise M27Error(f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise M27Error(f"{path}: no such file") from exc
    except UnicodeDecodeError as exc:
        raise M27Error(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except OSError as exc:
        raise M27Error(f"{path}: {exc.strerror}") from exc


def _print_json(data: Any) -> None:
    print(json.dumps(msgspec.to_builtins(data), indent=2))


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "—"


# ---------------------------------------------------------------- commands


def cmd_up(args: argparse.Namespace) -> int:
    home = m27_home()
    print(f"starting m27 under {home} …", file=sys.stderr, flush=True)
    state, started = system.up(home, nodes=args.nodes, gpus=args.gpus)
    _print_up(state, started)
    return 0


def _print_up(state: system.EmbeddedState, started: bool) -> None:
    verb = "started" if started else "already running"
    gpus = f"{state.gpus} (simulated GPUs: no NVIDIA GPU found)" if state.simulated_gpus \
        else state.gpus
    print(f"m27 {verb}: api {state.api}, nats {state.nats_url}, "
          f"{sum(p.name.startswith('node-agent') for p in state.processes)} node(s), "
          f"GPUs {gpus}")


def cmd_down(args: argparse.Namespace) -> int:
    state = system.down(m27_home())
    print("m27 stopped" if state else "m27 was not running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = system.read_state(m27_home())
    if state is None:
        if args.json:
            print(json.dumps({"up": False, "home": str(m27_home()), "processes": []}))
        else:
            print(f"m27 is not running (home {m27_home()}); start it with `m27 up`")
        return 1
    if args.json:
        print(system.status_json(state))
        return 0
    print(f"m27 under {state.home}: api {state.api}, nats {state.nats_url}, GPUs {state.gpus}"
          + (" (simulated)" if state.simulated_gpus else ""))
    for row in system.statuses(state):
        mark = "up  " if row.alive else "DOWN"
        print(f"  {mark} {row.name:<18} pid {row.pid:<8} {row.grpc_address}")
    return 0 if system.is_up(state) else 1


def cmd_submit(args: argparse.Namespace) -> int:
    text = _read_pipeline(args.file)
    variables = _parse_vars(args.var)
    workdir = (args.workdir or Path.cwd()).resolve()
    urgency: Urgency = args.urgency

    async def work(client: Client) -> int:
        run_id = await client.submit(text, vars=variables, user=args.user, urgency=urgency,
                                     workdir=str(workdir), source_name=str(args.file))
        print(run_id, flush=True)
        if not args.watch:
            return 0
        run = await _watch.watch(client, run_id, out=sys.stderr)
        return _watch.exit_code_for(run)

    return _with_client(args, work)


def cmd_watch(args: argparse.Namespace) -> int:
    async def work(client: Client) -> int:
        run = await _watch.watch(client, args.run_id)
        _print_outcome(run.state, run.report_path)
        return _watch.exit_code_for(run)

    return _with_client(args, work)


def _print_outcome(state: str, report_path: str) -> None:
    print(f"run {state}" + (f"; report: {report_path}" if report_path else ""))


def cmd_runs(args: argparse.Namespace) -> int:
    runs = _with_client(args, lambda c: c.list_runs(args.limit))
    if args.json:
        _print_json(runs)
        return 0
    if not runs:
        print("no runs yet; submit one with `m27 submit FILE`")
        return 0
    print(f"{'RUN':<24} {'NAME':<20} {'STATE':<10} {'STEPS':<9} {'USER':<12} SUBMITTED")
    for run in runs:
        steps = f"{run.steps_succeeded}/{run.steps_total}"
        print(f"{run.run_id:<24} {run.name[:20]:<20} {run.state:<10} {steps:<9} "
              f"{run.user[:12]:<12} {_when(run.created_at)}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    run = _with_client(args, lambda c: c.get_run(args.run_id))
    if args.json:
        _print_json(run)
        return 0
    print(f"run {run.run_id} ({run.name}) by {run.user}: {run.state}"
          + (f" — {run.reason}" if run.reason else ""))
    for step in run.steps:
        took = format_duration(step.ended_at - step.started_at) \
            if step.started_at and step.ended_at else ""
        gpu = f" GPU {','.join(map(str, step.gpu_ids))}×{step.gpu_share:g}" if step.gpu_ids \
            else ""
        sim = " (simulated)" if step.gpu_simulated else ""
        code = f" exit {step.exit_code}" if step.exit_code is not None else ""
        print(f"  {step.name:<20} {step.type:<9} {step.state:<9} {step.node_id or '':<10}"
              f"{gpu}{sim}{code} {took}")
        if step.state == "failed" and step.stderr_tail:
            for line in step.stderr_tail.rstrip().splitlines()[-10:]:
                print(f"      | {line}")
    if run.report_path:
        print(f"report: {run.report_path}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    state = _with_client(args, lambda c: c.cancel(args.run_id, args.reason))
    print(f"run {args.run_id}: cancel requested ({state})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from m27.demo import demo_pipeline

    home = m27_home()
    state, started = system.up(home)
    _print_up(state, started)
    workdir = home / "demo" / time.strftime("%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True, exist_ok=True)
    text, variables = demo_pipeline(epochs=args.epochs)

    async def work(client: Client) -> int:
        run_id = await client.submit(text, vars=variables, workdir=str(workdir),
                                     source_name="m27-demo.yaml")
        print(f"demo run {run_id} (working in {workdir})", flush=True)
        run = await _watch.watch(client, run_id)
        report = run.report_path or await _wait_for_report(client, run_id)
        _print_outcome(run.state, report)
        if not report:
            print("m27: the report service wrote no report in time; see `m27 status`",
                  file=sys.stderr)
            return 1
        return _watch.exit_code_for(run)

    args.api = state.api
    return _with_client(args, work)


async def _wait_for_report(client: Client, run_id: str) -> str:
    deadline = time.monotonic() + REPORT_WAIT_S
    while time.monotonic() < deadline:
        run = await client.get_run(run_id)
        if run.report_path:
            return run.report_path
        await asyncio.sleep(0.25)
    return ""
