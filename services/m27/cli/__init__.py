"""The `m27` command line: bring the system up, submit and follow pipelines.

Every failure a user can cause or fix ends in one line on stderr and a non-zero exit code,
never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from m27 import __version__
from m27.cli import (
    _agent,
    _api,
    _bus,
    _checkpoints,
    _cluster,
    _compare,
    _events,
    _queue,
    _runs,
    _simulate,
    _system,
)
from m27.common.errors import M27Error
from m27.common.paths import m27_home

EPILOG = """\
typical use:
  m27 up                       start NATS and every service on this machine
  m27 plan pipeline.yaml       check a pipeline and see its plan (no system needed)
  m27 submit pipeline.yaml --var INPUT_FILE=data/1abc.pdb --watch
  m27 runs --state failed      runs, newest first, filtered
  m27 retry RUN                run again what did not succeed
  m27 events --run RUN -f      a run's bus events, one line each, then new ones (--json for jq)
  m27 nodes                    nodes and GPUs: utilization, memory, who holds what
  m27 queue --explain          what waits, in which order, and why (score breakdown)
  m27 node drain NODE          no new work; checkpointing tasks move elsewhere
  m27 logs RUN STEP -f         a step's output, following it while it runs
  m27 checkpoints RUN STEP     a step's checkpoints; `restore` copies one to a directory
  m27 compare RUN [RUN...]     runs or a sweep's members: final and best metrics, figures
  m27 demo                     run the bundled demo pipeline end to end
  m27 simulate --trace FILE    replay a trace under scheduling policies (simulated GPUs)
  m27 bus credentials DIR      NATS users for a deployment (`m27 up` makes its own)
  m27 api token create --user alice   an API token for a lab member (docs/security.md)
  m27 agent --nats URL --creds FILE   this machine joins a lab as a node (`m27 agent -h`)
  m27 down                     stop everything (runs are kept)

environment: M27_HOME (data dir), M27_CONFIG (config file, default ~/.m2config),
M27_API (orchestrator address when not using the embedded system), M27_REPORT (the report
service's, for `m27 compare`), M27_TOKEN (your API token, instead of [client] token_file
or the one `m27 up` writes).
exit codes: 0 ok / run succeeded, 1 error / run failed, 2 bad usage, 3 run cancelled.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="m27", description="m27 keeps a lab's GPUs busy: it runs experiment pipelines "
        "(data prep → GPU training → analysis → report) on whole or fractional GPUs.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"m27 {__version__}")
    parser.add_argument("--api", metavar="HOST:PORT",
                        help="orchestrator address (default: $M27_API, [client] api, or the "
                        "embedded system started by `m27 up`)")
    parser.add_argument("--config", metavar="FILE", help="config file (default ~/.m2config)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _system.add_commands(sub)
    _runs.add_commands(sub)
    _events.add_commands(sub)
    _cluster.add_commands(sub)
    _queue.add_commands(sub)
    _compare.add_commands(sub)
    _checkpoints.add_commands(sub)
    _simulate.add_commands(sub)
    _bus.add_commands(sub)
    _api.add_commands(sub)
    _agent.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.home = m27_home()  # $M27_HOME, read once: every command takes it from here
    try:
        code = args.handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except M27Error as exc:
        print(f"m27: {exc}", file=sys.stderr)
        code = 1
    raise SystemExit(code)
