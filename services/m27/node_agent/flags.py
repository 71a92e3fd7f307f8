"""The node-agent's command line and the checks of its `[node]` settings."""

from __future__ import annotations

import argparse
import os
from typing import Final

from m27.common.config import NodeSection, Overrides, node_id_default
from m27.common.errors import ConfigError
from m27.common.ids import is_valid_name
from m27.common.service import service_parser
from m27.node_agent._gpus import GpuSpec, parse_gpu_spec

NAME: Final = "node-agent"
MIN_HEARTBEAT_S: Final = 0.1
_NODE_ID_HELP: Final = ("letters, digits, '_' and '-', starting with a letter or digit, "
                        "at most 100 characters")


def _node_id_arg(value: str) -> str:
    if not is_valid_name(value):
        raise argparse.ArgumentTypeError(f"invalid node id {value!r}: use {_NODE_ID_HELP}")
    return value


def _gpus_arg(value: str) -> str:
    try:
        parse_gpu_spec(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser(
        "node_agent",
        "Registers this node and its GPUs, heartbeats, and runs the steps the scheduler "
        "places here, each in its own process group.")
    parser.add_argument("--node-id", type=_node_id_arg,
                        help="this node's id ([node] id; default: the host name)")
    parser.add_argument("--gpus", type=_gpus_arg, metavar="SPEC",
                        help="auto (NVML if an NVIDIA GPU is present), none, sim:N or "
                        "sim:NxMEM for N SIMULATED GPUs, e.g. sim:2x16GiB ([node] gpus)")
    parser.add_argument("--cpu-slots", type=int, metavar="N",
                        help="CPU tasks this node runs at once ([node] cpu_slots; "
                        "0: the number of cores)")
    parser.add_argument("--heartbeat-interval", metavar="DURATION",
                        help="e.g. 5s ([node] heartbeat_interval)")
    parser.add_argument("--sample-interval", metavar="DURATION",
                        help="how often GPU utilization is read for idle detection, e.g. 1s "
                        "([node] sample_interval; at most the heartbeat interval)")
    return parser


def overrides(args: argparse.Namespace) -> Overrides:
    """The flags as config overrides; flags not given (None) leave the config alone."""
    return {
        ("node", "id"): args.node_id,
        ("node", "gpus"): args.gpus,
        ("node", "cpu_slots"): args.cpu_slots,
        ("node", "heartbeat_interval"): args.heartbeat_interval,
        ("node", "sample_interval"): args.sample_interval,
    }


def resolve_node_id(configured: str) -> str:
    """`[node] id`, else the host name; ConfigError for an id that cannot name a subject."""
    node_id = configured.strip() or node_id_default()
    if not is_valid_name(node_id):
        raise ConfigError(f"[node] id = {node_id!r}: invalid node id; use {_NODE_ID_HELP}")
    return node_id


def gpu_spec(settings: NodeSection) -> GpuSpec:
    try:
        return parse_gpu_spec(settings.gpus)
    except ValueError as exc:
        raise ConfigError(f"[node] gpus = {settings.gpus!r}: {exc}") from exc


def check_settings(settings: NodeSection, node_timeout: float) -> None:
    if settings.heartbeat_interval < MIN_HEARTBEAT_S:
        raise ConfigError(f"[node] heartbeat_interval = {settings.heartbeat_interval:g}s: "
                          f"must be at least {MIN_HEARTBEAT_S:g}s")
    if settings.sample_interval < MIN_HEARTBEAT_S:
        raise ConfigError(f"[node] sample_interval = {settings.sample_interval:g}s: must be "
                          f"at least {MIN_HEARTBEAT_S:g}s")
    if not settings.heartbeat_interval < settings.lease_fence_after < node_timeout:
        raise ConfigError(
            f"[node] lease_fence_after = {settings.lease_fence_after:g}s must be longer than "
            f"[node] heartbeat_interval ({settings.heartbeat_interval:g}s) and shorter than "
            f"[scheduler] node_timeout ({node_timeout:g}s): a cut-off node must stop its "
            "tasks before they are started elsewhere")


def cpu_slots(settings: NodeSection) -> int:
    return settings.cpu_slots or os.cpu_count() or 1
