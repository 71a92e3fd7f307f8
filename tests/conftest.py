"""Fixtures that start the real thing: nats-server on a free port, services as processes.

Point the suite at an existing server with M27_TEST_NATS_URL (its streams are shared then).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from m27.client import Client
from m27.common import api_auth
from m27.embedded import NatsServer
from m27.embedded.processes import ServiceProcess, launch, stop, wait_ready
from tests.botapi import BotApi
from tests.support import Cluster, embedded

StartService = Callable[..., ServiceProcess]


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream (fsync always) and its own temporary store."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    external = os.environ.get("M27_TEST_NATS_URL")
    if external:
        return external
    assert nats_server.url is not None
    return nats_server.url


@pytest.fixture
def m27_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated $M27_HOME and an empty config file, so no user settings leak in."""
    home = tmp_path / "m27home"
    home.mkdir()
    config = tmp_path / "m2config"
    config.write_text("")
    monkeypatch.setenv("M27_HOME", str(home))
    monkeypatch.setenv("M27_CONFIG", str(config))
    api_auth.ensure_cli_token(home, api_auth.login_name())  # as `m27 up` does
    return home


@pytest.fixture
def start_service(nats_url: str, m27_home: Path) -> Iterator[StartService]:
    """Start `python -m m27.<module>` against the test's NATS; all are stopped at the end."""
    started: list[ServiceProcess] = []

    def _start(module: str, *args: str, name: str | None = None,
               timeout: float = 60.0) -> ServiceProcess:
        proc_name = name or module
        proc = launch(proc_name, f"m27.{module}", ["--nats", nats_url, *args],
                      log_dir=m27_home / "logs")
        started.append(proc)
        wait_ready([proc], timeout=timeout)
        return proc

    yield _start
    stop(started)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One running system per test module (starting one costs about a second)."""
    system = Cluster(tmp_path_factory.mktemp("cluster"))
    system.start()
    yield system
    system.stop()


@pytest.fixture
async def client(system: Cluster) -> AsyncIterator[Client]:
    """A client of the module's `system` (each scheduling test module starts its own)."""
    async with system.client() as connected:
        yield connected


@pytest.fixture(scope="module", params=["loopback", "tls"])
def attacked_home(tmp_path_factory: pytest.TempPathFactory,
                  request: pytest.FixtureRequest) -> Iterator[Path]:
    """`m27 up` with two nodes, as attack suites use it: once as it starts on loopback and
    again with mutual TLS on, since no defence may depend on how connections are carried."""
    root = tmp_path_factory.mktemp("secure")
    with embedded(root, tls=request.param == "tls", nodes=2, gpus="sim:1") as home:
        yield home


@pytest.fixture
def bot_api() -> Iterator[BotApi]:
    """A Telegram Bot API stand-in on 127.0.0.1 (`tests/botapi.py`): point a bot's
    `[telegram] api_url` at `bot_api.url` with `bot_api.token`."""
    with BotApi() as api:
        yield api
