"""The orchestrator's command line (`python -m m27.orchestrator --help`)."""

from __future__ import annotations

import argparse
from typing import Final

from m27.common.config import Overrides
from m27.common.service import service_parser

NAME: Final = "orchestrator"


def build_parser() -> argparse.ArgumentParser:
    return service_parser(NAME, "Serves m27.v1.PipelineService: turns pipeline YAML into "
                          "runs, keeps their state in JetStream KV and releases each step "
                          "once its dependencies succeeded.")


def overrides(args: argparse.Namespace) -> Overrides:
    """No flags of its own: the shared ones (--nats, --grpc, --config) are all it takes."""
    return {}
