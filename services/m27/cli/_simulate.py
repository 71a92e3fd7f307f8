"""`m27 simulate`: replay a trace under one or more policies in virtual time and report
allocation, utilization, goodput, completion times and night jobs by morning.

Runs on this machine alone (no system, no NATS); every GPU in it is simulated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Final

import msgspec
from rich.progress import TaskID

from m27.cli._common import Subparsers, add
from m27.cli._live import progress
from m27.common.errors import M27Error
from m27.common.units import parse_duration
from m27.sim import (
    POLICY_HELP,
    POLICY_NAMES,
    LabParams,
    MaintenanceSim,
    Metrics,
    RawRun,
    SimConfig,
    Trace,
    format_preemptions,
    format_table,
    generate_lab,
    is_philly,
    jct_cdf_svg,
    make_nodes,
    make_policy,
    read_philly,
    read_trace,
    simulate,
    summarize,
    utilization_svg,
    write_jsonl,
)

EPILOG: Final = """\
policies:
""" + "\n".join(f"  {name:<10} {text}" for name, text in POLICY_HELP.items()) + """

trace formats (docs/simulator.md): m27's JSONL (*.jsonl), an Alibaba openb pod list
(openb_pod_list_*.csv, with openb_node_list_gpu_node.csv beside it or --node-list), the
Philly job table (timestamp,duration,num_gpus,...; sample it with --start/--days).

examples:
  m27 simulate --generate lab --gpus 16 --hours 72 -o lab.jsonl   # write a lab trace
  m27 simulate --trace lab.jsonl --policy m27,by-hand,fifo --hours 72 --plots out/
  m27 simulate --trace philly.csv --policy fifo,tiresias --start 2017-10-09 --days 7 \\
      --nodes 16 --gpus-per-node 8 --format json
"""


def add_commands(sub: Subparsers) -> None:
    parser = add(sub, "simulate", "replay a cluster trace under scheduling policies in "
                 "virtual time (simulated GPUs) and compare utilization, goodput and JCT",
                 cmd_simulate)
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, metavar="FILE",
                        help="the trace to replay (.jsonl, openb pod list, Philly table)")
    source.add_argument("--generate", choices=("lab",),
                        help="write a generated trace instead of replaying one: `lab` is the "
                        "lab workload (docs/simulator.md) on --gpus GPUs over --hours, "
                        "seeded by --seed, to -o FILE")
    parser.add_argument("--gpus", type=int, default=8, metavar="N",
                        help="--generate: GPUs of the cluster (default 8; up to 8 on one "
                        "node, more in nodes of 8)")
    parser.add_argument("-o", "--output", type=Path, metavar="FILE",
                        help="--generate: where to write the trace (.jsonl)")
    parser.add_argument("--policy", default="m27", metavar="NAME[,NAME...]",
                        help=f"policy or comma-separated policies ({', '.join(POLICY_NAMES)}); "
                        "default m27")
    parser.add_argument("--nodes", type=int, metavar="N",
                        help="replace the trace's cluster by N nodes (with --gpus-per-node)")
    parser.add_argument("--gpus-per-node", type=int, default=8, metavar="G",
                        help="GPUs per node with --nodes (default 8)")
    parser.add_argument("--hours", type=float, metavar="H",
                        help="simulate H hours (default: until every job is done)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="seed for failures (default 0)")
    parser.add_argument("--failure-mtbf-h", type=float, default=0.0, metavar="H",
                        help="mean running hours between a task's crashes (default 0: none)")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--plots", type=Path, metavar="DIR",
                        help="write utilization.svg and jct_cdf.svg into DIR")
    parser.add_argument("--node-list", type=Path, metavar="FILE",
                        help="openb node list (default: openb_node_list_gpu_node.csv beside "
                        "the pod list)")
    parser.add_argument("--start", default="", metavar="DATE",
                        help="Philly: first submission day to replay (default: the first)")
    parser.add_argument("--days", type=float, metavar="D",
                        help="Philly: replay D days of submissions (default: all)")
    parser.add_argument("--maintenance", choices=("none", "cron", "window"), default="none",
                        help="a nightly reset of every node: cron kills what runs then (a "
                        "crontab line); window is m27's maintenance window (keeps work that "
                        "would be cut short away for --maintenance-lead, empties each node, "
                        "then resets it). Default none")
    parser.add_argument("--maintenance-at", default="03:00", metavar="HH:MM",
                        help="when the nightly reset starts, on the trace's clock (03:00)")
    parser.add_argument("--maintenance-s", type=float, default=120.0, metavar="S",
                        help="how long a node's reset takes (default 120 s)")
    parser.add_argument("--maintenance-lead", default="2h", metavar="DURATION",
                        help="window: how long before it work that would be cut short is "
                        "kept away (default 2h)")


def load(args: argparse.Namespace) -> Trace:
    if args.nodes is not None and (args.nodes < 1 or args.gpus_per_node < 1):
        raise M27Error("--nodes and --gpus-per-node must be at least 1")
    if is_philly(args.trace):
        nodes = make_nodes(args.nodes or 2, args.gpus_per_node)
        return read_philly(args.trace, nodes=nodes, start=args.start, days=args.days,
                           checkpoint_s=600.0)
    if args.start or args.days is not None:
        raise M27Error("--start and --days apply to the Philly job table only")
    return read_trace(args.trace, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                      node_list=args.node_list)


def policy_names(args: argparse.Namespace) -> list[str]:
    """The policies asked for, checked before the (possibly large) trace is read."""
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise M27Error(f"unknown policy {', '.join(unknown) or '(none)'}: choose from "
                       f"{', '.join(POLICY_NAMES)}")
    return names


def maintenance_of(args: argparse.Namespace) -> MaintenanceSim | None:
    if args.maintenance == "none":
        return None
    hour, _, minute = args.maintenance_at.partition(":")
    if not (hour.isdigit() and minute.isdigit() and int(hour) < 24 and int(minute) < 60):
        raise M27Error(f"--maintenance-at {args.maintenance_at[:40]!r}: expected HH:MM")
    if not 0 <= args.maintenance_s <= 86400:
        raise M27Error("--maintenance-s: between 0 and 86400")
    try:
        lead = parse_duration(args.maintenance_lead)
    except ValueError as exc:
        raise M27Error(f"--maintenance-lead: {exc}") from exc
    return MaintenanceSim(mode=args.maintenance, at_s=int(hour) * 3600.0 + int(minute) * 60.0,
                          command_s=args.maintenance_s, lead_s=lead)


def run_all(args: argparse.Namespace, trace: Trace) -> list[tuple[Metrics, RawRun]]:
    names = policy_names(args)
    horizon = args.hours * 3600.0 if args.hours is not None else None
    if horizon is not None and horizon <= 0:
        raise M27Error("--hours must be positive")
    cfg = SimConfig(horizon_s=horizon, seed=args.seed, failure_mtbf_h=args.failure_mtbf_h,
                    maintenance=maintenance_of(args))
    out = []
    with progress(sys.stderr) as bars:
        for name in names:
            policy = make_policy(name, trace)
            bar = bars.add_task(f"simulating {name}", total=None)

            def advance(done: int, total: int, bar: TaskID = bar) -> None:
                bars.update(bar, completed=done, total=total)

            try:
                raw = simulate(trace, policy, cfg, on_progress=advance)
            except M27Error:
                raise
            except Exception as exc:  # a policy's bug: one line, not a traceback
                raise M27Error(f"policy {name} failed: {type(exc).__name__}: {exc}") from exc
            out.append((summarize(raw, policy=name, trace=trace.name), raw))
    return out


def write_plots(directory: Path, runs: list[tuple[Metrics, RawRun]]) -> None:
    labelled = [(m.policy, raw) for m, raw in runs]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "utilization.svg").write_text(utilization_svg(labelled))
        (directory / "jct_cdf.svg").write_text(jct_cdf_svg(labelled))
    except OSError as exc:
        raise M27Error(f"cannot write plots to {directory}: {exc.strerror or exc}") from None


def generate(args: argparse.Namespace) -> int:
    """`--generate lab`: write the lab workload as a JSONL trace."""
    if args.output is None:
        raise M27Error("--generate needs -o FILE (where to write the trace)")
    if args.gpus < 1 or (args.gpus > 8 and args.gpus % 8):
        raise M27Error(f"--gpus {args.gpus}: use 1–8 (one node) or a multiple of 8 "
                       "(nodes of 8)")
    hours = 72.0 if args.hours is None else args.hours
    if hours <= 0:
        raise M27Error("--hours must be positive")
    nodes, per_node = (1, args.gpus) if args.gpus <= 8 else (args.gpus // 8, 8)
    trace = generate_lab(LabParams(nodes=nodes, gpus_per_node=per_node, hours=hours,
                                   seed=args.seed))
    try:
        write_jsonl(trace, args.output)
    except OSError as exc:
        raise M27Error(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {args.output}: the lab workload, {len(trace.jobs)} jobs on {nodes} × "
          f"{per_node} simulated GPUs over {hours:g} h (seed {args.seed}); replay it with "
          f"m27 simulate --trace {args.output} --hours {hours:g}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.generate:
        return generate(args)
    policy_names(args)
    trace = load(args)
    if not trace.jobs:
        raise M27Error(f"{args.trace}: no jobs to replay (check --start/--days)")
    runs = run_all(args, trace)
    if args.plots is not None:
        write_plots(args.plots, runs)
    if args.format == "json":
        body = {"trace": trace.name, "jobs": len(trace.jobs), "skipped": len(trace.skipped),
                "simulated_gpus": True, "runs": [msgspec.to_builtins(m) for m, _ in runs]}
        print(json.dumps(body, indent=2))
        return 0
    print(f"trace {trace.name}: {len(trace.jobs)} jobs on {len(trace.nodes)} nodes, "
          f"{runs[0][0].gpus} simulated GPUs"
          + (f" ({len(trace.skipped)} rows skipped)" if trace.skipped else ""))
    print(format_table([m for m, _ in runs]))
    thrash = format_preemptions([m for m, _ in runs])
    if thrash:
        print(thrash)
    refused = {m.policy: m.rejected_decisions for m, _ in runs if m.rejected_decisions}
    if refused:
        print(f"decisions refused by the simulator: {refused}", file=sys.stderr)
    return 0
