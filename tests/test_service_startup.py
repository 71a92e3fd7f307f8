"""Every service fails fast and clearly without NATS, and stops promptly when told to."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m27.common import api_auth
from m27.common.bus import connect
from m27.embedded import NatsServer

pytestmark = pytest.mark.integration

MODULES = ["orchestrator", "scheduler", "node_agent", "checkpoint_store", "report"]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(module: str, tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "M27_HOME": str(tmp_path), "M27_CONFIG": os.devnull,
           "M27_NATS_CONNECT_TIMEOUT": "1s"}
    return subprocess.Popen(
        [sys.executable, "-m", f"m27.{module}", "--nats", f"nats://127.0.0.1:{closed_port()}",
         "--log-json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("module", MODULES)
def test_without_nats_a_service_exits_1_naming_the_url(module: str, tmp_path: Path) -> None:
    began = time.monotonic()
    proc = start(module, tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out
    assert "cannot reach NATS at nats://127.0.0.1:" in out
    assert "Traceback" not in out
    assert time.monotonic() - began < 15


def test_sigterm_while_waiting_for_nats_stops_at_once(tmp_path: Path) -> None:
    env_timeout = "60s"
    env = {**os.environ, "M27_HOME": str(tmp_path), "M27_CONFIG": os.devnull,
           "M27_NATS_CONNECT_TIMEOUT": env_timeout}
    proc = subprocess.Popen(
        [sys.executable, "-m", "m27.scheduler", "--nats", f"nats://127.0.0.1:{closed_port()}",
         "--log-json"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # it is in the connect loop once nats-py has failed once
        if '"nats.error"' in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out
    assert "service.stopped_while_starting" in out


def test_a_bad_config_value_is_one_line_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "m2config"
    config.write_text("[checkpoint]\ncompression_level = 40\n")
    env = {**os.environ, "M27_HOME": str(tmp_path), "M27_CONFIG": str(config)}
    proc = subprocess.run([sys.executable, "-m", "m27.checkpoint_store", "--nats",
                           "nats://127.0.0.1:1"], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"m27.checkpoint-store: {config}: [checkpoint] compression_level = '40': "
        "expected `int` <= 22"]


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.3, 0.8])
def test_a_cancelled_connect_leaves_nothing_running(delay_s: float) -> None:
    """A service told to stop while it waits for NATS must not leave nats-py's retry loop
    behind: asyncio.run would wait on it at exit, and the process would never end."""
    async def scenario() -> list[asyncio.Task[object]]:
        waiting = asyncio.ensure_future(
            connect(f"nats://127.0.0.1:{closed_port()}", name="t", timeout=60))
        await asyncio.sleep(delay_s)
        waiting.cancel()
        done, _ = await asyncio.wait({waiting}, timeout=5)
        assert done, "connect() did not stop when cancelled"
        assert waiting.cancelled()
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(scenario()) == []


def test_a_bad_notification_rule_is_one_line_naming_it(tmp_path: Path) -> None:
    api_auth.ensure_cli_token(tmp_path, api_auth.login_name())
    env = {**os.environ, "M27_HOME": str(tmp_path), "M27_CONFIG": os.devnull,
           "M27_NOTIFY_RULES": "run_failed -> webhook\nrun_faild -> webhook"}
    server = NatsServer(tmp_path / "nats")
    try:
        proc = subprocess.run([sys.executable, "-m", "m27.report", "--nats", server.start(),
                               "--log-json"], env=env, capture_output=True, text=True,
                              timeout=60)
    finally:
        server.stop()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert ("[notify] rules: rule 2 ('run_faild -> webhook'): unknown notification kind "
            "'run_faild'") in out
    assert "Traceback" not in out
