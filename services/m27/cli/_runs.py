"""`m27 plan`, `submit`, `watch`, `runs`, `show`, `cancel`, `retry`: pipelines and runs."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import get_args

import msgspec

from m27.cli import _watch
from m27.cli._common import (
    NotRunningError,
    Subparsers,
    add,
    api_address,
    config,
    parse_secrets,
    parse_since,
    parse_vars,
    print_json,
    read_pipeline,
    when,
    with_client,
)
from m27.cli._history import NoStoredRuns, read_runs
from m27.client import Client, ClientError, RunSummary
from m27.common.errors import InvalidRequest, NotFoundError
from m27.common.ids import is_valid_run_id
from m27.common.model import URGENCIES, RunRecord, RunState, StepRecord, Urgency
from m27.common.units import format_duration
from m27.orchestrator import history
from m27.orchestrator.store import RunStore
from m27.pipeline import PipelineError, load_pipeline
from m27.pipeline.plan import Plan, make_plan, render_text

RUN_STATES = get_args(RunState)


def add_commands(sub: Subparsers) -> None:
    plan = add(sub, "plan", "validate a pipeline and show its execution plan without running "
               "it (levels, resources, critical path; with a running system also start "
               "estimates and reused steps)", cmd_plan)
    _pipeline_args(plan)
    plan.add_argument("--format", choices=("text", "json"), default="text")
    submit = add(sub, "submit", "submit a pipeline YAML file; prints the run id", cmd_submit)
    _pipeline_args(submit)
    submit.add_argument("--urgency", choices=URGENCIES,
                        help="the run's priority (default: the file's `priority:`, else normal)")
    submit.add_argument("--user", default="", help="submit on behalf of this user (admins "
                        "only; default: the user your API token names)")
    submit.add_argument("--watch", action="store_true", help="follow the run until it ends")
    watch = add(sub, "watch", "follow a run live; exit 0 if it succeeds", cmd_watch)
    watch.add_argument("run_id", metavar="RUN")
    _add_runs(sub)
    show = add(sub, "show", "show one run: every step with its times, attempts, node, exit "
               "code and outputs (also while the system is down)", cmd_show)
    show.add_argument("run_id", metavar="RUN")
    show.add_argument("--json", action="store_true")
    cancel = add(sub, "cancel", "stop a run's running steps (SIGTERM, then SIGKILL after a "
                 "grace period) and cancel the rest", cmd_cancel)
    cancel.add_argument("run_id", metavar="RUN")
    cancel.add_argument("--step", default="", metavar="NAME",
                        help="cancel only this step; its dependents are skipped")
    cancel.add_argument("--reason", default="")
    retry = add(sub, "retry", "run again the steps of a finished run that did not succeed",
                cmd_retry)
    retry.add_argument("run_id", metavar="RUN")
    retry.add_argument("--watch", action="store_true", help="follow the run until it ends")


def _pipeline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                        help="fill {{NAME}} (repeatable); a value never becomes shell syntax")
    parser.add_argument("--secret", action="append", default=[], metavar="NAME[=VALUE]",
                        help="a secret variable (repeatable): its value from the environment "
                        "variable NAME, or VALUE; usable only in env:/secrets: values, never "
                        "stored with the run, shown as *** and masked in the logs")
    parser.add_argument("--workdir", type=Path,
                        help="directory the steps run in (default: the current directory)")
    parser.add_argument("--no-cache", action="store_true",
                        help="run every step even if an identical earlier one could be reused")


def _add_runs(sub: Subparsers) -> None:
    runs = add(sub, "runs", "list runs, newest first (also while the system is down: read "
               "from its stored data)", cmd_runs)
    runs.add_argument("--state", action="append", choices=RUN_STATES, default=[],
                      help="only runs in this state (repeatable)")
    runs.add_argument("--user", default="", help="only this user's runs (an admin's "
                      "choice: others see only their own)")
    runs.add_argument("--since", default="", metavar="WHEN",
                      help="only runs submitted since: 2h, 3d, or a date like 2026-12-01")
    runs.add_argument("--limit", type=int, default=20, help="runs per page (default 20)")
    runs.add_argument("--page", default="", metavar="TOKEN", help="the page after TOKEN")
    runs.add_argument("--all", action="store_true", help="every page")
    runs.add_argument("--json", action="store_true")


# ---------------------------------------------------------------- plan and submit


def cmd_plan(args: argparse.Namespace) -> int:
    text = read_pipeline(args.file)
    variables = parse_vars(args.var)
    secrets = parse_secrets(args.secret, os.environ)
    workdir = str((args.workdir or Path.cwd()).resolve())
    cfg = config(args)
    try:
        spec = load_pipeline(text, variables, source=str(args.file), workdir=workdir,
                             gpu_light_share=cfg.scheduler.gpu_light_share, secrets=secrets)
    except PipelineError as exc:
        print(f"m27: {exc}", file=sys.stderr)
        return 1
    plan = _server_plan(args, text, variables, workdir, secrets) or make_plan(spec)
    print(_plan_json(plan) if args.format == "json" else render_text(plan))
    return 1 if plan.capacity_problems else 0


def _server_plan(args: argparse.Namespace, text: str, variables: dict[str, str],
                 workdir: str, secrets: dict[str, str]) -> Plan | None:
    """The running system's plan (estimates, cache, capacity), or None without one."""
    try:
        api_address(args, config(args))
    except NotRunningError:
        return None
    try:
        return with_client(args, lambda c: c.plan(text, vars=variables, workdir=workdir,
                                                  source_name=str(args.file),
                                                  no_cache=args.no_cache, secrets=secrets))
    except ClientError as exc:
        print(f"m27: planning without the running system ({exc})", file=sys.stderr)
        return None


def _plan_json(plan: Plan) -> str:
    import msgspec

    return msgspec.json.format(msgspec.json.encode(plan), indent=2).decode()


def cmd_submit(args: argparse.Namespace) -> int:
    text = read_pipeline(args.file)
    variables = parse_vars(args.var)
    secrets = parse_secrets(args.secret, os.environ)
    workdir = (args.workdir or Path.cwd()).resolve()
    urgency: Urgency | None = args.urgency

    async def work(client: Client) -> int:
        run_id = await client.submit(text, vars=variables, user=args.user, urgency=urgency,
                                     workdir=str(workdir), source_name=str(args.file),
                                     no_cache=args.no_cache, secrets=secrets)
        print(run_id, flush=True)
        if not args.watch:
            return 0
        run = await _watch.watch(client, run_id, out=sys.stderr)
        failed = _watch.outcome_lines(run)[:-1]  # the run's state is on the watch already
        if failed:
            print("\n".join(failed), file=sys.stderr)
        return _watch.exit_code_for(run)

    return with_client(args, work)


def cmd_watch(args: argparse.Namespace) -> int:
    async def work(client: Client) -> int:
        run = await _watch.watch(client, args.run_id)
        _watch.print_outcome(run, run.report_path)
        return _watch.exit_code_for(run)

    return with_client(args, work)


# ---------------------------------------------------------------- history


def cmd_runs(args: argparse.Namespace) -> int:
    since = parse_since(args.since, time.time()) if args.since else 0.0

    async def work(client: Client) -> tuple[list[RunSummary], str]:
        found, token = await client.list_runs(args.limit, states=args.state, user=args.user,
                                              since=since, page_token=args.page)
        while args.all and token:
            more, token = await client.list_runs(args.limit, states=args.state,
                                                 user=args.user, since=since, page_token=token)
            found.extend(more)
        return found, token

    async def stored(store: RunStore) -> tuple[list[RunSummary], str]:
        query = history.Query(limit=args.limit, states=frozenset(args.state), user=args.user,
                              since=since, after=args.page)
        found, token = await history.list_runs(store, query)
        while args.all and token:
            more, token = await history.list_runs(store, msgspec.structs.replace(
                query, after=token))
            found.extend(more)
        return [RunSummary.of(run) for run in found], token

    try:
        runs, token = read_runs(args, work, stored)
    except NoStoredRuns:
        runs, token = [], ""
    if args.json:
        print_json({"runs": runs, "next_page_token": token})
        return 0
    if not runs:
        print("no runs match" if args.state or args.user or args.since
              else "no runs yet; submit one with `m27 submit FILE`")
        return 0
    print(f"{'RUN':<24} {'NAME':<20} {'STATE':<10} {'STEPS':<9} {'USER':<12} SUBMITTED")
    for run in runs:
        steps = f"{run.steps_succeeded}/{run.steps_total}"
        print(f"{run.run_id:<24} {run.name[:20]:<20} {run.state:<10} {steps:<9} "
              f"{run.user[:12]:<12} {when(run.created_at)}")
    if token:
        print(f"more: m27 runs --page {token}" + (f" --limit {args.limit}"
                                                  if args.limit != 20 else ""))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    async def stored(store: RunStore) -> RunRecord:
        if not is_valid_run_id(args.run_id):
            raise InvalidRequest(f"not a run id: {args.run_id[:80]!r} (run ids look like "
                                 "r-20261201-081500-a1b2c3)")
        return (await store.get(args.run_id))[0].run

    try:
        run = read_runs(args, lambda c: c.get_run(args.run_id), stored)
    except NoStoredRuns as exc:
        raise NotFoundError(f"no run {args.run_id}: {exc}") from None
    if args.json:
        print_json(run)
        return 0
    print("\n".join(show_lines(run)))
    return 0


def show_lines(run: RunRecord) -> list[str]:
    """`m27 show`: the run, then each step with its attempts and outputs."""
    took = format_duration(run.ended_at - run.created_at) if run.ended_at else "running"
    lines = [f"run {run.run_id} ({run.name}) by {run.user}: {run.state} — {took}"
             + (f" — {run.reason}" if run.reason else ""),
             f"  submitted {when(run.created_at)}, workdir {run.workdir or '(per-run scratch)'}"]
    for step in run.steps:
        lines.extend(_step_lines(step))
    if run.report_path:
        lines.append(f"report: {run.report_path}")
    return lines


def _step_lines(step: StepRecord) -> list[str]:
    took = format_duration(step.ended_at - step.started_at) \
        if step.started_at and step.ended_at else ""
    gpu = f" GPU {','.join(map(str, step.gpu_ids))}×{step.gpu_share:g}" if step.gpu_ids else ""
    sim = " (simulated)" if step.gpu_simulated else ""
    code = f" exit {step.exit_code}" if step.exit_code is not None else ""
    attempt = f" attempt {step.attempt}" if step.attempt > 1 else ""
    if step.preemptions:
        attempt += f" ({step.preemptions} preempted)"
    lines = [f"  {step.name:<24} {step.type:<9} {step.state:<9} {step.node_id or '':<10}"
             f"{gpu}{sim}{code}{attempt} {took}".rstrip()]
    if step.started_at:
        energy = (f", GPU energy {step.energy_j / 1000:.2f} kJ"
                  + (" (simulated)" if step.gpu_simulated else "")) if step.energy_j else ""
        lines.append(f"      started {when(step.started_at)}, ended {when(step.ended_at)}"
                     f"{energy}")
    if step.cached_from:
        lines.append(f"      reused the results of {step.cached_from}")
    elif step.reason and step.state != "succeeded":
        lines.append(f"      {step.reason}")
    for old in step.history[:-1] if step.state in {"succeeded", "failed"} else step.history:
        lines.append(f"      attempt {old.attempt} on {old.node_id or '?'}: {old.reason} "
                     f"({old.cause})")
    if step.outputs:
        lines.append(f"      outputs: {', '.join(step.outputs)}")
    if step.state == "failed" and step.stderr_tail:
        lines.extend(f"      | {line}" for line in _watch.stderr_tail(step))
    return lines


def cmd_cancel(args: argparse.Namespace) -> int:
    state = with_client(args, lambda c: c.cancel(args.run_id, args.reason, step=args.step))
    what = f"step {args.step} of run {args.run_id}" if args.step else f"run {args.run_id}"
    print(f"{what}: cancel requested (run is {state})")
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    async def work(client: Client) -> int:
        state, steps = await client.retry(args.run_id)
        print(f"run {args.run_id}: {len(steps)} step(s) will run again ({', '.join(steps)}); "
              f"run is {state}")
        if not args.watch:
            return 0
        run = await _watch.watch(client, args.run_id)
        _watch.print_outcome(run, run.report_path)
        return _watch.exit_code_for(run)

    return with_client(args, work)
