"""The one config loader: INI file, M27_* environment, flags; clear errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from m27.common.config import load_config
from m27.common.errors import ConfigError

MISSION_EXAMPLE = """\
[performance]
gpu_streams = 4              # CUDA streams used for async copies
memory_overprovision = 1.2   # GPU memory overcommit factor for fractional packing
io_timeout = 50ms            # storage wait that counts as an I/O stall
[checkpoint]
compression_level = 3        # zstd
diff_threshold = 128KB       # smallest change stored as a diff
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m2config"
    path.write_text(text)
    return path


def test_the_config_users_already_have_loads(tmp_path: Path) -> None:
    loaded = load_config(write(tmp_path, MISSION_EXAMPLE), environ={})
    cfg = loaded.config
    assert cfg.performance.gpu_streams == 4
    assert cfg.performance.memory_overprovision == 1.2
    assert cfg.performance.io_timeout == pytest.approx(0.05)
    assert cfg.checkpoint.compression_level == 3
    assert cfg.checkpoint.diff_threshold == 128 * 1024
    assert loaded.warnings == ()


def test_defaults_without_a_file(tmp_path: Path) -> None:
    cfg = load_config(tmp_path / "missing", environ={}).config
    assert cfg.checkpoint.compression_level == 3
    assert cfg.checkpoint.diff_threshold == 131072
    assert cfg.performance.memory_overprovision == 1.0
    assert cfg.node.heartbeat_interval == 5.0


def test_unknown_keys_and_sections_are_warned_about(tmp_path: Path) -> None:
    path = write(tmp_path, "[checkpoint]\ncompresion_level = 5\n[gpus]\nx = 1\n")
    loaded = load_config(path, environ={})
    assert len(loaded.warnings) == 2
    assert "unknown key [checkpoint] compresion_level" in loaded.warnings[0]
    assert "compression_level" in loaded.warnings[0]
    assert "unknown section [gpus]" in loaded.warnings[1]


@pytest.mark.parametrize(("text", "expected"), [
    ("[checkpoint]\ncompression_level = fast\n", "[checkpoint] compression_level = 'fast'"),
    ("[checkpoint]\ncompression_level = 40\n", "[checkpoint] compression_level = '40'"),
    ("[checkpoint]\ndiff_threshold = huge\n", "expected a size"),
    ("[performance]\nio_timeout = soon\n", "expected a duration"),
    ("[performance]\nmemory_overprovision = 0.5\n", "memory_overprovision"),
    ("not an ini file\n", "not a valid INI file"),
])
def test_bad_values_are_rejected_naming_the_key(tmp_path: Path, text: str,
                                                expected: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_config(write(tmp_path, text), environ={})
    assert expected in str(info.value)
    assert "m2config" in str(info.value)


def test_environment_beats_file_and_flags_beat_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "[checkpoint]\ncompression_level = 5\n[nats]\nurl = nats://f:1\n")
    env = {"M27_CHECKPOINT_COMPRESSION_LEVEL": "7", "M27_NATS_URL": "nats://env:2"}
    cfg = load_config(path, environ=env,
                      overrides={("nats", "url"): "nats://flag:3"}).config
    assert cfg.checkpoint.compression_level == 7
    assert cfg.nats.url == "nats://flag:3"


def test_a_bad_environment_value_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\$M27_NODE_HEARTBEAT_INTERVAL"):
        load_config(tmp_path / "none", environ={"M27_NODE_HEARTBEAT_INTERVAL": "often"})


def test_m27_config_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[checkpoint]\ncompression_level = 9\n")
    cfg = load_config(environ={"M27_CONFIG": str(path)}).config
    assert cfg.checkpoint.compression_level == 9
