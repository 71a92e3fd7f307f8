"""The report service's command line (`python -m m27.report --help`)."""

from __future__ import annotations

import argparse
from typing import Final

from m27.common import subjects
from m27.common.config import Overrides
from m27.common.service import service_parser

NAME: Final = "report"


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser(NAME, "Writes an HTML report of every run that ends.")
    parser.add_argument("--api", metavar="HOST:PORT", default="",
                        help="the orchestrator's gRPC address (default: the one registered "
                        f"in the {subjects.SERVICES_BUCKET} bucket)")
    parser.add_argument("--out", metavar="DIR",
                        help="where reports are written ([report] dir; default: "
                        "$M27_HOME/reports)")
    return parser


def overrides(args: argparse.Namespace) -> Overrides:
    """The config keys this service's flags set (None: not given, the config decides)."""
    return {(NAME, "dir"): args.out}
