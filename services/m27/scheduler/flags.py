"""The scheduler's command line (`python -m m27.scheduler --help`)."""

from __future__ import annotations

import argparse
from typing import Final

from m27.common.config import Overrides
from m27.common.service import service_parser

NAME: Final = "scheduler"


def build_parser() -> argparse.ArgumentParser:
    return service_parser(NAME, "Takes steps whose dependencies succeeded and starts each on "
                          "a node with room: a whole GPU for `gpu`, a share of one for "
                          "`gpu_light`, a CPU slot for `cpu`.")


def overrides(args: argparse.Namespace) -> Overrides:
    """No flags of its own: its settings are the config's [scheduler] section."""
    return {}
