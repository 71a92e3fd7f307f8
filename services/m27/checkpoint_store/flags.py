"""The checkpoint-store's command line (`python -m m27.checkpoint_store --help`)."""

from __future__ import annotations

import argparse
from typing import Final

from m27.common.config import Overrides
from m27.common.service import service_parser
from m27.common.units import parse_size

NAME: Final = "checkpoint-store"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("checkpoint_store",
                            "Stores checkpoints of tasks (content-addressed chunks on a "
                            "directory, manifests in NATS KV) and serves them over gRPC.")
    parser.add_argument("--root", metavar="DIR",
                        help="where checkpoint chunks are kept: local disk, NAS or Lustre "
                        "([checkpoint] dir; default: $M27_HOME/checkpoints)")
    parser.add_argument("--max-size", metavar="SIZE", type=_size,
                        help="the largest checkpoint accepted, e.g. 64GiB "
                        "([checkpoint] max_size; default: 64GiB)")
    return parser


def overrides(args: argparse.Namespace) -> Overrides:
    """The flags as config overrides; flags not given (None) leave the config alone."""
    return {("checkpoint", "dir"): args.root, ("checkpoint", "max_size"): args.max_size}
