"""Flags, config overrides and the checks of the [node] settings."""

from __future__ import annotations

import pytest

from m27.common.config import NodeSection, load_config
from m27.common.errors import ConfigError
from m27.node_agent._gpus import GpuSpec
from m27.node_agent.flags import (
    build_parser,
    check_settings,
    cpu_slots,
    gpu_spec,
    overrides,
    resolve_node_id,
)


def test_flags_become_node_config_overrides(tmp_path: object) -> None:
    args = build_parser().parse_args(["--nats", "nats://h:1", "--node-id", "gpu-01",
                                      "--gpus", "sim:2", "--cpu-slots", "3",
                                      "--heartbeat-interval", "1s"])
    loaded = load_config(None, environ={"M27_CONFIG": "/nonexistent"},
                         overrides=overrides(args))
    node = loaded.config.node
    assert (node.id, node.gpus, node.cpu_slots, node.heartbeat_interval) == \
        ("gpu-01", "sim:2", 3, 1.0)


def test_flags_not_given_leave_the_config_alone() -> None:
    args = build_parser().parse_args([])
    loaded = load_config(None, environ={"M27_CONFIG": "/nonexistent",
                                        "M27_NODE_GPUS": "sim:4"},
                         overrides=overrides(args))
    assert loaded.config.node == NodeSection(gpus="sim:4")


@pytest.mark.parametrize("argv", [
    ["--node-id", "bad.id"], ["--node-id", "-x"], ["--node-id", "a b"],
    ["--gpus", "sim:0"], ["--gpus", "cuda"], ["--cpu-slots", "many"],
])
def test_bad_flags_are_rejected_with_one_line(argv: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines()
                   if "error:" in line]
    assert len(error_lines) == 1


def test_node_id_defaults_to_a_valid_host_name() -> None:
    assert resolve_node_id("gpu-07") == "gpu-07"
    default = resolve_node_id("")
    assert default
    assert "." not in default


@pytest.mark.parametrize("bad", ["a.b", "node/1", "x" * 101, "_lead"])
def test_invalid_configured_node_ids_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"\[node\] id"):
        resolve_node_id(bad)


def test_gpu_spec_from_config() -> None:
    assert gpu_spec(NodeSection(gpus="sim:2")) == GpuSpec(mode="sim", count=2,
                                                          memory_mb=16384)
    with pytest.raises(ConfigError, match=r"\[node\] gpus = 'two'"):
        gpu_spec(NodeSection(gpus="two"))


def test_heartbeat_interval_must_be_positive() -> None:
    check_settings(NodeSection(heartbeat_interval=0.5), 15.0)
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        check_settings(NodeSection(heartbeat_interval=0.0), 15.0)


def test_cpu_slots_default_to_the_cores() -> None:
    assert cpu_slots(NodeSection(cpu_slots=3)) == 3
    assert cpu_slots(NodeSection()) >= 1
